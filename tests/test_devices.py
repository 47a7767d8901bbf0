"""Every tensor handed to a model is on that model's device (the first CUDA crash: the
generators' reference pass fed a CPU batch to a CUDA model). On a CPU-only machine the second
device is "meta": a strict fake model lives there and rejects inputs from anywhere else."""
import pytest
import torch
import torch.nn as nn

from common.contracts.batch import Trajectory
from common.contracts.ops import reference_seq_logp, token_logp


class DeviceMismatch(RuntimeError):
    pass


class StrictModel(nn.Module):
    """Answers `model(tokens, targets=..., temperature=...)` with zeros on its own device, after
    checking every tensor it was given is there too (a real model would fail or, worse, copy)."""

    def __init__(self, device="meta"):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, device=device))
        self.seen: list[torch.device] = []

    @property
    def device(self):
        return self.w.device

    def forward(self, tokens, targets=None, temperature=1.0):
        for t in (tokens, targets):
            if t is not None:
                self.seen.append(t.device)
                if t.device != self.device:
                    raise DeviceMismatch(f"input on {t.device}, model on {self.device}")
        return torch.zeros(tokens.shape, device=self.device) + self.w


def _trajs():
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, c) in enumerate(((3, 4), (5, 2), (2, 6))):
        out.append(Trajectory(torch.randint(3, 90, (p,), generator=g), torch.randint(3, 90, (c,), generator=g),
                              torch.zeros(c), torch.zeros(c, dtype=torch.long), 0.0, i))
    return out


def test_the_strict_model_rejects_a_batch_on_another_device():
    """What the old reference pass did: a CPU batch into a model on another device."""
    with pytest.raises(DeviceMismatch, match="input on cpu, model on meta"):
        token_logp(StrictModel(), torch.zeros(2, 5, dtype=torch.long), 0.7)


def test_reference_seq_logp_feeds_the_model_on_its_device():
    """Generators (TBA's reference term), evaluation's KL and red-teaming's fluency term all go
    through this helper: the CPU-built batch arrives on the model's device."""
    model = StrictModel()
    out = reference_seq_logp(model, _trajs(), 0.7)
    assert out.shape == (3,) and out.device.type == "meta"
    assert model.seen and all(d.type == "meta" for d in model.seen)
