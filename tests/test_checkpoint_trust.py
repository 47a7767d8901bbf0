"""Checkpoints are read without running code: a planted pickle in a checkpoint's DCP state (its
`.metadata`, or a non-tensor entry of its shards) or in its buffer.pt is refused with a
CheckpointError naming the file and the global, and what it would have run never runs; a damaged
buffer.pt, or one whose sizes are not the run's (a capacity of 10^12), is refused before anything is
allocated from it; the files this project writes still load."""
from __future__ import annotations

import ast
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from common.engine.checkpoints.hf_io import load_model
from common.contracts.errors import UserError
from common.runtime.shared.buffer import _FORMAT, ReplayBuffer
from common.runtime.files.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from common.runtime.files.state import _MetadataUnpickler, _allowed, check_state, read_state
from tests.tiny import save_hf


class _Plant:
    """A pickle that creates `marker` when unpickled (what an attacker's file would do, harmless)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "llama_tied"
    save_hf("llama_tied", d)
    return d


def _setup(model_dir, stepped=True):
    model, _ = load_model(str(model_dir), tokenizer=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stepped:
        model(torch.randint(3, 97, (2, 8))).float().logsumexp(-1).mean().backward()
        opt.step()
    return model, opt


def _restamp(ckpt: Path) -> None:
    """Record the files' new sizes in meta.json, as an attacker who edits a checkpoint would."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"] = {rel: (ckpt / rel).stat().st_size for rel in meta["files"]}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _globals(f: Path) -> set[str]:
    """Every global a DCP .metadata references, read through the allow-list (which refuses others)."""
    seen = set()

    class Recording(_MetadataUnpickler):
        def find_class(self, module, name):
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)
    with open(f, "rb") as fh:
        Recording(fh).load()
    return seen


def test_the_plant_would_run_under_plain_pickle(tmp_path):
    """The test's plant is real: plain pickle runs it (so a refusal below is the reader's doing)."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Plant(marker)))
    assert marker.exists()


@pytest.mark.parametrize("stepped", [False, True])
def test_what_we_write_references_only_allowed_globals(model_dir, tmp_path, stepped):
    model, opt = _setup(model_dir, stepped)
    p = save_checkpoint(tmp_path, 1, model, opt)
    seen = _globals(p / "state" / ".metadata")
    assert {"torch.distributed.checkpoint.metadata.Metadata", "torch.Size"} <= seen
    assert all(_allowed(*g.rsplit(".", 1)) for g in seen)
    check_state(p / "state", model, stepped)  # read through the allow-list
    assert load_checkpoint(p, model, opt).step == 1


def test_planted_metadata_is_refused_and_never_runs(model_dir, tmp_path):
    model, opt = _setup(model_dir)
    p = save_checkpoint(tmp_path, 3, model, opt)
    marker = tmp_path / "pwned"
    (p / "state" / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    _restamp(p)  # sizes match: only the reader stands between the file and --resume
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"state/\.metadata: not a checkpoint this project wrote: it "
                                              r"references the disallowed global (posix|os|nt)\.system") as e:
        load_checkpoint(p, model, opt)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="disallowed global"):  # the ranks' path (read_shards)
        read_state(p / "state", model, opt, True)
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched


def test_garbage_metadata_is_unreadable_not_run(model_dir, tmp_path):
    model, opt = _setup(model_dir)
    p = save_checkpoint(tmp_path, 1, model, opt)
    (p / "state" / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    _restamp(p)
    with pytest.raises(CheckpointError, match=r"\.metadata: not a checkpoint this project wrote \(holds a dict"):
        load_checkpoint(p, model, opt)
    (p / "state" / ".metadata").write_bytes(b"\x80\x04garbage")
    _restamp(p)
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable checkpoint metadata"):
        load_checkpoint(p, model, opt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_planted_entry_in_the_shards_is_refused_and_never_runs(model_dir, tmp_path):
    """A non-tensor entry of the state (the optimizer's learning rate) is a pickle too: DCP's own
    planner loads those with weights_only=False."""
    model, opt = _setup(model_dir)
    p = save_checkpoint(tmp_path, 2, model, opt)
    marker = tmp_path / "pwned"
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = _Plant(marker)
    for f in (p / "state").iterdir():
        f.unlink()
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=p / "state", no_dist=True)
    _restamp(p)
    with pytest.raises(CheckpointError, match=r"state: not a checkpoint this project wrote: its entry "
                                              r"optimizer\.param_groups\.0\.lr references the disallowed global "
                                              r"(posix|os|nt)\.system"):
        load_checkpoint(p, model, opt)
    assert not marker.exists()


def _with_buffer(model_dir, tmp_path):
    """A checkpoint with a 4 x 16 buffer; the model, the optimizer, the checkpoint and its weights."""
    model, opt = _setup(model_dir)
    p = save_checkpoint(tmp_path, 1, model, opt, buffer=ReplayBuffer(capacity=4, max_seq_len=16))
    return model, opt, p, {k: v.clone() for k, v in model.state_dict().items()}


def test_planted_or_damaged_buffer_is_one_line_and_never_runs(model_dir, tmp_path):
    model, opt, p, before = _with_buffer(model_dir, tmp_path)
    assert load_checkpoint(p, model, opt, buffer_size=(4, 16)).buffer.capacity == 4  # what we write loads
    marker = tmp_path / "pwned"
    torch.save({"format": _FORMAT, "capacity": _Plant(marker)}, p / "buffer.pt")
    _restamp(p)
    with pytest.raises(CheckpointError, match=r"buffer\.pt: not a replay buffer this project wrote: it references the "
                                              r"disallowed global (posix|os|nt)\.system, so it was not read") as e:
        load_checkpoint(p, model, opt, buffer_size=(4, 16))
    assert isinstance(e.value, UserError) and "\n" not in str(e.value) and not marker.exists()
    data = (p / "buffer.pt").read_bytes()
    (p / "buffer.pt").write_bytes(data[:len(data) // 2] + bytes(len(data) - len(data) // 2))  # same size, damaged
    with pytest.raises(CheckpointError, match=r"buffer\.pt: damaged replay buffer, not readable \(RuntimeError: "):
        load_checkpoint(p, model, opt)
    torch.save({"x": torch.zeros(1)}, p / "buffer.pt")
    _restamp(p)
    with pytest.raises(CheckpointError, match=r"buffer\.pt: not a replay buffer this project wrote \(it lacks the format"):
        load_checkpoint(p, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # refused before anything mutated


def test_a_buffer_of_absurd_size_is_refused_before_it_is_allocated(model_dir, tmp_path):
    """A saved capacity of 10^12 (or any size not the run's) is refused with the numbers; without the
    run's sizes (a notebook's load), a column that claims more rows than its data holds is."""
    model, opt, p, _ = _with_buffer(model_dir, tmp_path)
    state = torch.load(p / "buffer.pt", weights_only=True)
    torch.save({**state, "capacity": 10**12}, p / "buffer.pt")
    _restamp(p)
    with pytest.raises(CheckpointError, match=r"buffer\.pt: the saved replay buffer is 1,000,000,000,000 rows x 16 "
                                              r"tokens, this run's is 4 rows \(--train\.buffer_capacity\) x 16 tokens"):
        load_checkpoint(p, model, opt, buffer_size=(4, 16))
    with pytest.raises(CheckpointError, match=r"damaged replay buffer: its column 'tokens' is \(4, 16\) torch\.int32, "
                                              r"its sizes make it \(1000000000000, 16\)"):
        load_checkpoint(p, model, opt)
    huge = {k: v[:1].expand(10**12, *v.shape[1:]) for k, v in state["cols"].items()}  # stride 0: 10^12 rows of one
    torch.save({**state, "capacity": 10**12, "cols": huge}, p / "buffer.pt")
    _restamp(p)
    with pytest.raises(CheckpointError, match=r"its column 'tokens' claims \(1000000000000, 16\) but its data holds "
                                              r"256 bytes"):
        load_checkpoint(p, model, opt)
    torch.save({**state, "max_seq_len": 8}, p / "buffer.pt")  # a run of other sizes: said with both
    _restamp(p)
    with pytest.raises(CheckpointError, match=r"is 4 rows x 8 tokens, this run's is 4 rows .* x 16 tokens .* resume "
                                              r"with the settings the checkpoint was written with"):
        load_checkpoint(p, model, opt, buffer_size=(4, 16))


def test_every_other_checkpoint_read_is_weights_only_or_json():
    """torch.load is weights_only=True everywhere a run reads a file (checkpoint, buffer, HF .bin),
    and nothing reads a file with pickle.load (checked on the source, nothing imported)."""
    root = Path(__file__).resolve().parents[1]
    loads = 0
    for f in [p for pkg in ("common", "tba", "areal") for p in (root / pkg).rglob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.attr == "load"):
                continue
            where = f"{f.relative_to(root)}:{node.lineno}"
            assert node.func.value.id != "pickle", f"{where}: pickle.load"
            if node.func.value.id == "torch":
                loads += 1
                assert any(k.arg == "weights_only" and getattr(k.value, "value", None) is True
                           for k in node.keywords), f"{where}: torch.load without weights_only=True"
    assert loads >= 3  # the scan sees them: trainer_state.pt, buffer.pt, pytorch_model*.bin
