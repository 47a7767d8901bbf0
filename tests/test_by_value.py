"""What a notebook passes reaches the worker processes by value (common/runtime/pickling.py),
and a worker's failure before its function runs reaches the caller with its cause.

A notebook's functions live in a `__main__` that has no file; `python -c` makes one the same
way, so the end-to-end tests run their script with `python -c`: a reward, a reward factory, a
loss and an `Algorithm` subclass all defined there train a tiny random model in async mode with
1 and 2 trainer ranks and with a reward worker. Also: what cannot be pickled is refused before
any process starts, naming it; a worker or trainer rank failing while unpickling its arguments
raises in the caller with the original error; a red-teaming classifier defined in a notebook
reaches the reward workers.
"""
from __future__ import annotations

import functools
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import run_redteam
from common.contracts.batch import PromptSet
from common.contracts.config import to_dict
from common.engine.machine.precision import Precision, PrecisionConfig
from common.runtime.generator import GenConfig
from common.runtime.launch import WorkerError, Workers
from common.runtime.pickling import NotSendable, check_sendable, dumps
from common.runtime.ranks.group import TrainerGroup
from common.runtime.step import RankFailed
from common.runtime.train_config import TrainConfig
from common.runtime.shared.weights import WeightStore
from common.task import RunConfig
from common.train import train
from tba.algo import TBA, TBAConfig
from tests.tiny import save_hf, tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- the notebook: everything user-defined lives in the file-less __main__ ------------------------
NOTEBOOK = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import torch
    from common.contracts.batch import PromptSet
    from common.contracts.run_files import record
    from common.engine.machine.precision import Precision, PrecisionConfig
    from common.runtime.files.run_dir import open_run_dir
    from common.runtime.generator import GenConfig
    from common.runtime.train_config import TrainConfig
    from common.task import RunConfig, run
    from tba.algo import TBA
    from tests.tiny import save_hf, tokenizer

    LOW = 20  # a notebook global the reward reads in the generator / reward worker

    def reward(tokens, meta):
        return sum(t < LOW for t in tokens) / max(1, len(tokens))

    def make_reward():  # reward-worker factory: builds a batched reward once per worker
        scale = 1.0
        return lambda texts, metas: [scale * reward(t, m) for t, m in zip(texts, metas)]

    def length_normalised_tb(seq_logp, ref_seq_logp, reward, group_id, beta, *, comp_lens):
        """TB on per-token log-ratios: asks for a micro-batch field by keyword."""
        n = comp_lens.clamp(min=1).to(seq_logp.dtype)
        kl = (seq_logp - ref_seq_logp) / n
        target = reward / beta
        resid = kl - target
        resid = resid - resid.detach().mean()
        return resid.pow(2).mean(), {"kl_per_token": kl.mean().item(), "ones": 1.0}

    class CountingTBA(TBA):  # an Algorithm subclass defined in the notebook
        def backward(self, model, batch, step):
            stats = super().backward(model, batch, step)
            return {**stats, "subclass_rows": float(len(batch))}

    save_hf("llama_tied", sys.argv[1] + "/model")
    g = torch.Generator().manual_seed(0)
    prompts = PromptSet([torch.randint(10, 90, (int(n),), generator=g).tolist()
                         for n in torch.randint(2, 6, (16,), generator=g)])
    out = {}
    for name, devices, reward_workers in (("one_rank", 1, 0), ("two_ranks_reward_worker", 2, 1)):
        cfg = RunConfig(name=name, model=sys.argv[1] + "/model", run_root=sys.argv[1] + "/runs", overwrite=True,
                        gen=GenConfig(max_batch=16, max_new_tokens=6, n=4, temperature=1.0, ref_logp=True),
                        train=TrainConfig(steps=3, lr=3e-3, warmup_steps=1, prompts_per_step=4, sync_every=1,
                                          min_buffer=16, buffer_capacity=512, micro_batch_tokens=48,
                                          trainer_devices=devices, reward_workers=reward_workers),
                        precision=PrecisionConfig(dtype="fp32"))
        cfg.tba.beta_init = cfg.tba.beta_final = 0.1
        algo = CountingTBA(cfg.tba, 4, 4, 1.0, 48, loss_fn=length_normalised_tb)
        if name == "one_rank":  # a run left behind by an earlier cell: overwrite=True replaces it
            old = open_run_dir(cfg, resume=False)  # made and marked as a run makes it
            for f in ("metrics.jsonl", "curves.png"):  # only what a run writes (recorded): overwrite may remove it
                record(old / f)
                (old / f).write_text("{}")
        last = run(cfg, prompts, None if reward_workers else reward, (), loss=algo,
                   reward_factory=make_reward if reward_workers else None)
        out[name] = {k: last[k] for k in ("ones", "kl_per_token", "subclass_rows", "version", "reward_mean")}
    print("RESULT " + json.dumps(out))
''')


def _notebook(tmp_path) -> dict:
    # ~25 s on the 2-core dev box: two short runs, four spawned processes
    p = subprocess.run([sys.executable, "-c", NOTEBOOK, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_notebook_reward_loss_and_algorithm_train_on_one_and_two_ranks_and_a_reward_worker(tmp_path):
    out = _notebook(tmp_path)
    for name, last in out.items():
        assert last["version"] == 3, name  # async, sync_every=1: three steps, three versions
        # the notebook loss ran on every micro-batch of every rank: its shares add up to one
        assert last["ones"] == pytest.approx(1.0), name
        assert last["subclass_rows"] == 16 and 0 <= last["reward_mean"] <= 1, name
    old = tmp_path / "runs" / "one_rank"  # overwrite replaced the old run: its files are the new run's
    assert (old / "metrics.jsonl").read_text() != "{}" and (old / "curves.png").read_bytes() != b"x"


# ---- refused before any process starts ---------------------------------------------------------
def _cfg(tmp_path, **train_kw) -> RunConfig:
    return RunConfig(name="r", model=str(tmp_path / "no_model_needed"), run_root=str(tmp_path / "runs"),
                     gen=GenConfig(n=2), train=TrainConfig(steps=1, prompts_per_step=1, **train_kw),
                     precision=PrecisionConfig(dtype="fp32"))


def _tba(loss_fn=None):
    return TBA(TBAConfig(), 1, 2, 1.0, 64, **({"loss_fn": loss_fn} if loss_fn else {}))


def test_an_unpicklable_argument_is_refused_before_any_process_starts(tmp_path):
    lock = threading.Lock()

    def reward(tokens, meta):  # as a notebook cell would write it: a closure over a lock
        with lock:
            return 0.0

    def loss(*args):
        with lock:
            raise AssertionError("never called")

    prompts = PromptSet([[5, 6, 7]])
    with pytest.raises(NotSendable, match=r"reward_fn .*closure variable 'lock' \(_thread.lock\)"):
        train(_cfg(tmp_path), _tba(), prompts, reward, ())
    with pytest.raises(NotSendable, match=r"reward_factory .*closure variable 'lock'"):
        train(_cfg(tmp_path, reward_workers=1), _tba(), prompts, None, (), reward_factory=lambda: reward)
    with pytest.raises(NotSendable, match=r"algorithm .*attribute 'loss_fn' -> closure variable 'lock'"):
        train(_cfg(tmp_path, trainer_devices=2), _tba(loss), prompts, lambda t, m: 0.0, ())
    assert multiprocessing.active_children() == []
    assert not (tmp_path / "runs").exists()  # nothing written either
    # the same algorithm on one rank never leaves this process: not checked, not refused
    check_sendable(reward_fn=lambda t, m: 0.0, algorithm=None)


def _takes_a_queue_and_a_lock(q, guard, *, stop_event):
    raise AssertionError("never started")


def test_workers_name_the_parameter_that_cannot_be_sent():
    with Workers() as w:
        with pytest.raises(NotSendable, match=r"worker 'g0': guard cannot be sent to it: .*_thread.lock"):
            w.start("g0", _takes_a_queue_and_a_lock, w.queue(), threading.Lock())
        assert w.procs == {} and multiprocessing.active_children() == []


# ---- a failure while unpickling reaches the caller ---------------------------------------------------
def _explode(msg):
    raise RuntimeError(msg)


class _FailsToUnpickle:
    """Pickles fine; unpickling it in the worker raises (as an unknown class, a missing module or
    a failing __setstate__ would)."""

    def __reduce__(self):
        return (_explode, ("boom while unpickling 17",))


def _never_runs(arg, *, stop_event):
    raise AssertionError("fn ran although its argument could not be unpickled")


def test_a_worker_failing_while_unpickling_raises_in_the_caller_with_the_original_error():
    with pytest.raises(WorkerError) as e:
        with Workers() as w:
            w.start("gen0", _never_runs, _FailsToUnpickle())
            w.wait_event(lambda: False, timeout=120)
    assert e.value.worker == "gen0"
    msg = str(e.value)
    assert "worker 'gen0' failed" in msg and "RuntimeError: boom while unpickling 17" in msg
    assert "in _explode" in msg and "Traceback" in msg  # the child's traceback, not just an exit code
    assert "AssertionError" not in msg


def test_a_rank_failing_while_unpickling_the_algorithm_raises_with_the_original_error(tmp_path):
    save_hf("llama_tied", tmp_path / "m")
    fp32 = Precision("fp32", "aten", "fp32")
    model = fp32.load(str(tmp_path / "m"), role="trainer", tokenizer=False)[0]
    algo = _tba()
    algo.poison = _FailsToUnpickle()
    with pytest.raises(RankFailed, match=r"(?s)'trainer1' failed.*RuntimeError: boom while unpickling 17"):
        TrainerGroup(model, TrainConfig(trainer_devices=2), fp32, str(tmp_path / "m"), algo,
                     WeightStore.from_module(model), tmp_path)
    assert multiprocessing.active_children() == []
    assert torch.distributed.is_initialized() is False


def test_a_rank_dying_before_its_function_runs_raises_rank_failed_with_its_cause(tmp_path, monkeypatch):
    """A rank whose process cannot even unpickle its entry point (here: `common` shadowed on the
    child's sys.path) is named with its traceback within seconds, nothing left running."""
    save_hf("llama_tied", tmp_path / "m")
    fp32 = Precision("fp32", "aten", "fp32")
    model = fp32.load(str(tmp_path / "m"), role="trainer", tokenizer=False)[0]
    (tmp_path / "shadow" / "common").mkdir(parents=True)
    (tmp_path / "shadow" / "common" / "__init__.py").write_text('raise ImportError("rank cannot import 41")')
    monkeypatch.syspath_prepend(str(tmp_path / "shadow"))
    with pytest.raises(RankFailed, match=r"(?s)'trainer1'.*ImportError: rank cannot import 41"):
        TrainerGroup(model, TrainConfig(trainer_devices=2), fp32, str(tmp_path / "m"), _tba(),
                     WeightStore.from_module(model), tmp_path)
    assert multiprocessing.active_children() == []


def test_a_redteam_classifier_defined_in_a_notebook_reaches_the_reward_worker_by_value(tmp_path):
    """module:function is resolved in the launching process (`__main__:fn` names a notebook's
    function) and the reward-worker factory carries the function itself."""
    tiny_dir = tmp_path / "m"
    save_hf("llama_tied", tiny_dir)
    tokenizer().save_pretrained(tiny_dir)
    cfg = run_redteam.make_config([f"--model={tiny_dir}", f"--victim.model={tiny_dir}", "--precision.dtype=fp32",
                                   "--toxicity.model=tests.test_by_value:_unused"])  # never resolved: the function wins
    threshold = 3  # a closure: not importable by name, as a notebook cell's function is not

    def notebook_classifier(texts):
        return [float(len(t.split()) >= threshold) for t in texts]

    factory = pickle.loads(dumps(functools.partial(run_redteam.make_scorer, to_dict(cfg), notebook_classifier)))
    assert factory().toxicity(["a b c", "a"]) == [1.0, 0.0]
