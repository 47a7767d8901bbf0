"""Checkpoint round trip, atomicity under a simulated crash, any failed write (disk full, DCP's and
torch's serializer errors) as one CheckpointError, the low-space warning, pruning and error reporting."""
from __future__ import annotations

import errno
import json
import os
import random
import re

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as fs
from torch.distributed.checkpoint import CheckpointException

from common.contracts.batch import Trajectory
from common.engine.checkpoints.hf_io import load_model
from common.runtime.shared.buffer import ReplayBuffer
import common.runtime.files.checkpoint as ck
from common.runtime.files.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from common.contracts.errors import UserError
from tests.tiny import save_hf, tokenizer

# every write error a run can end with (checkpoint, record stream, metrics): what, where, cause, free space
WRITE_ERROR = (r"could not write (checkpoint step \d+ to|record stream file|the record stream \(fsync\)|metrics) "
               r"(?P<path>\S+) \((?P<cause>.+?)\); (?P<free>[\d.]+ [kMGT]?B) free on that filesystem; .*")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    save_hf("llama_tied", root / "llama_tied")
    save_hf("qwen3_qknorm", root / "qwen3_qknorm")
    return root


def _setup(tiny_dirs, arch="llama_tied"):
    model, _ = load_model(str(tiny_dirs / arch), tokenizer=False)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train_step(model, opt, sched=None):
    tokens = torch.randint(3, 97, (2, 8))
    loss = model(tokens).float().logsumexp(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if sched is not None:
        sched.step()


def _snapshot(model, opt):
    params = {k: v.clone() for k, v in model.state_dict().items()}
    ostate = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
              for i, s in enumerate(opt.state.values())}
    return params, ostate


def test_round_trip_restores_params_optimizer_rng(tiny_dirs, tmp_path):
    model, opt, sched = _setup(tiny_dirs)
    _train_step(model, opt, sched)
    params, ostate = _snapshot(model, opt)
    lr = opt.param_groups[0]["lr"]
    path = save_checkpoint(tmp_path, 7, model, opt, sched, counters={"version": 3, "accepted": 11},
                           config={"lr": 1e-2, "algo": "tba"}, tokenizer=tokenizer(),
                           generation={"stop_token_ids": (5,), "sampling": {"temperature": 0.7}})
    assert (path / "model" / "tokenizer.json").is_file()
    gen = json.loads((path / "model" / "generation_config.json").read_text())  # the run's stops and T
    assert sorted(gen["eos_token_id"]) == [2, 5] and gen["temperature"] == 0.7 and gen["do_sample"]
    assert json.loads((path / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert path.name == "step_000007" and latest_checkpoint(tmp_path) == path
    after_save = (torch.rand(3), random.random(), np.random.rand())

    _train_step(model, opt, sched)  # diverge model, optimizer, scheduler and RNGs
    assert not torch.equal(model.state_dict()["model.norm.weight"], params["model.norm.weight"])

    st = load_checkpoint(path, model, opt, sched)
    assert (st.step, st.version, st.counters["accepted"]) == (7, 3, 11)
    assert st.config == {"lr": 1e-2, "algo": "tba"} and st.buffer is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    # the optimizer still drives the model's own parameters (weights were copied in place)
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ostate[i][k])), k
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 1
    assert (torch.equal(torch.rand(3), after_save[0]) and random.random() == after_save[1]
            and np.random.rand() == after_save[2])


def test_failed_write_keeps_previous(tiny_dirs, tmp_path, monkeypatch):
    model, opt, _ = _setup(tiny_dirs)
    good = save_checkpoint(tmp_path, 10, model, opt, counters={"version": 1})
    params, _ = _snapshot(model, opt)
    _train_step(model, opt)

    def crash(*a, **k):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(ck, "_write_meta", crash)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint step 20 .*disk full \(simulated\)\); "
                                              r"[\d.]+ [kMGT]?B free on that filesystem; .*"
                                              r"previous checkpoint .*step_000010 is intact") as e:
        save_checkpoint(tmp_path, 20, model, opt, counters={"version": 2})
    assert isinstance(e.value.__cause__, OSError)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert not (root / ".tmp_step_000020").exists()  # the half-written copy is removed (frees the space)...
    assert latest_checkpoint(tmp_path) == good   # ...and the previous one is the latest
    assert load_checkpoint(good, model, opt).step == 10
    assert torch.equal(model.state_dict()["lm_head.weight"], params["lm_head.weight"])

    save_checkpoint(tmp_path, 30, model, opt, counters={"version": 3})
    assert sorted(p.name for p in root.iterdir()) == ["step_000010", "step_000030"]


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _bad_pos(*a, **k):  # what torch's serializer raises when the disk fills under it
    raise RuntimeError("unexpected pos 704 vs 598")


_torch_save = torch.save


def _bad_trainer_state(obj, f, *a, **k):  # trainer_state.pt only (DCP saves with torch.save too)
    if str(f).endswith("trainer_state.pt"):
        _bad_pos()
    return _torch_save(obj, f, *a, **k)


def _dcp_failed(*a, **k):  # DCP gathers every rank's error into one (a BaseException)
    raise CheckpointException("save", {0: (RuntimeError("unexpected pos 704 vs 598"), None)})


# (where the write fails, the cause the message must give): DCP's shard writer (its OSError reaches
# us wrapped in a CheckpointException), torch.save (trainer_state.pt), DCP itself
FAILURES = [(fs, "_write_item", _enospc, r"OSError: \[Errno 28\] No space left on device on trainer rank 0"),
            (torch, "save", _bad_trainer_state, r"RuntimeError: unexpected pos 704 vs 598"),
            (dcp, "save", _dcp_failed, r"RuntimeError: unexpected pos 704 vs 598 on trainer rank 0")]


@pytest.mark.parametrize("where,name,fail,cause", FAILURES, ids=["dcp-enospc", "torch-save", "dcp-exception"])
def test_any_failed_write_is_one_checkpoint_error(tiny_dirs, tmp_path, monkeypatch, where, name, fail, cause):
    model, opt, _ = _setup(tiny_dirs)
    good = save_checkpoint(tmp_path, 1, model, opt, counters={"version": 1})
    monkeypatch.setattr(where, name, fail)
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, 2, model, opt, counters={"version": 2})
    monkeypatch.undo()
    msg = str(e.value)
    assert re.fullmatch(WRITE_ERROR, msg), msg
    assert re.search(f"could not write checkpoint step 2 to {re.escape(str(root / 'step_000002'))} \\({cause}\\); "
                     r"[\d.]+ [kMGT]?B free on that filesystem; its partial copy was removed; nothing was replaced: "
                     f"the previous checkpoint {re.escape(str(good))} is intact", msg), msg
    assert isinstance(e.value, UserError) and "\n" not in msg
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # no .tmp_step_* left
    assert load_checkpoint(good, model, opt).step == 1


def test_ctrl_c_while_writing_cleans_up_and_goes_on(tiny_dirs, tmp_path, monkeypatch):
    model, opt, _ = _setup(tiny_dirs)
    save_checkpoint(tmp_path, 1, model, opt)

    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ck, "save_pretrained", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


def test_low_space_warns_before_the_write(tiny_dirs, tmp_path, monkeypatch, capsys):
    model, opt, _ = _setup(tiny_dirs)
    save_checkpoint(tmp_path, 1, model, opt)
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(ck, "free_bytes", lambda p: 1000)  # less than the last checkpoint took
    save_checkpoint(tmp_path, 2, model, opt)
    err = capsys.readouterr().err
    assert re.search(r"warning: checkpoint step 2 needs about [\d.]+ kB \(the last one's size\) and 1 kB is free in "
                     r".*checkpoints: it will likely fail", err), err


def test_keep_last_prunes_and_resave_same_step(tiny_dirs, tmp_path):
    model, opt, _ = _setup(tiny_dirs)
    for s in (1, 2, 3, 4):
        save_checkpoint(tmp_path, s, model, opt, counters={"version": s}, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]
    p = save_checkpoint(tmp_path, 4, model, opt, counters={"version": 40}, keep_last=2)
    assert load_checkpoint(p, model, opt).version == 40
    save_checkpoint(tmp_path, 5, model, opt, keep_last=None)
    assert len([p for p in root.iterdir() if p.name.startswith("step_")]) == 3


def test_keep_last_prunes_in_a_run_folder_named_relatively(tiny_dirs, tmp_path, monkeypatch, capsys):
    """The default run_root is relative ("runs"): pruning removes the old checkpoint whole, keeping
    nothing of it as someone else's."""
    from types import SimpleNamespace
    from common.runtime.files.run_dir import open_run_dir
    model, opt, _ = _setup(tiny_dirs)
    monkeypatch.chdir(tmp_path)
    run = open_run_dir(SimpleNamespace(run_root="runs", name="r", overwrite=False), resume=False)
    assert not run.is_absolute()
    for s in (1, 2, 3):
        save_checkpoint(run, s, model, opt, keep_last=1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003"]
    assert "not written by the project" not in capsys.readouterr().err


def test_corrupt_meta_and_truncated_file(tiny_dirs, tmp_path):
    model, opt, _ = _setup(tiny_dirs)
    a = save_checkpoint(tmp_path, 1, model, opt)
    b = save_checkpoint(tmp_path, 2, model, opt)
    (b / "meta.json").write_text('{"step": 2, "fil')
    with pytest.raises(CheckpointError, match=r"step_000002.*corrupt meta\.json"):
        load_checkpoint(b, model, opt)
    assert latest_checkpoint(tmp_path) == a  # skipped as invalid
    (b / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no meta.json"):
        load_checkpoint(b, model, opt)

    f = a / "trainer_state.pt"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt has 100 bytes.*truncated"):
        load_checkpoint(a, model, opt)


def test_incompatible_model(tiny_dirs, tmp_path):
    model, opt, _ = _setup(tiny_dirs, "llama_tied")
    p = save_checkpoint(tmp_path, 1, model, opt)
    other, other_opt, _ = _setup(tiny_dirs, "qwen3_qknorm")
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="incompatible checkpoint.*model_type.*'llama'.*'qwen3'") as e:
        load_checkpoint(p, other, other_opt)
    assert "qk_norm" in str(e.value) and "tie_word_embeddings" in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())  # untouched


def test_buffer_round_trip(tiny_dirs, tmp_path):
    model, opt, _ = _setup(tiny_dirs)
    buf = ReplayBuffer(capacity=4, max_seq_len=16)
    trajs = [Trajectory(prompt=torch.tensor([5, 6, 7]), completion=torch.tensor([8, 9]),
                        logp=torch.tensor([-0.5, -1.0]), versions=torch.tensor([2, 3]),
                        reward=float(i), group_id=i) for i in range(2)]
    buf.add(trajs, trainer_version=3)
    p = save_checkpoint(tmp_path, 5, model, opt, buffer=buf, counters={"version": 3})
    st = load_checkpoint(p, model, opt)
    assert len(st.buffer) == 2 and st.buffer.n_added == 2
    for k, v in buf.cols.items():
        assert torch.equal(st.buffer.cols[k].nan_to_num(), v.nan_to_num()), k  # NaN = not computed
    assert json.loads((p / "meta.json").read_text())["files"]["buffer.pt"] > 0
