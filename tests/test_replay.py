"""Record and replay (common/runtime/files/stream.py, common/replay.py):
replaying a recorded async run (TBA and AReaL, fp32, one rank) ends on the run's final
weights; a stream survives a kill and a resume; bad streams are refused with clear errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.engine.model.causal_attention import kernel_enabled
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.linear import onednn_available, onednn_enabled
from common.contracts.log import read_metrics
from common.replay import main as replay_main
from common.replay import replay, replay_config
from common.runtime.files.checkpoint import latest_checkpoint
from common.runtime.files.stream import StreamError, read_meta, read_steps, step_file
from common.task import areal_defaults, make_algo
from common.train import train
from tba.algo import TBA, TBAConfig
from tests.close import assert_update_close
from tests.test_e2e import _cfg, _prompts, toy_reward
from tests.tiny import save_hf

ROOT = Path(__file__).resolve().parents[1]


def _record_cfg(tmp_path, algo="tba", **train_kw):
    cfg = _cfg(tmp_path, **{"steps": 6, "record": True, **train_kw})
    cfg.algo = algo
    if algo == "areal":
        cfg = areal_defaults(cfg)
        cfg.areal.n_minibatches = 2
    cfg.tba = TBAConfig(beta_init=0.1, beta_final=0.05, beta_anneal_steps=4, m=0.5)
    return cfg


def _final_weights(run_dir) -> dict:
    return load_model(str(latest_checkpoint(run_dir) / "model"), tokenizer=False)[0].state_dict()


def _assert_same_weights(a: dict, b: dict) -> None:
    """Bit for bit: the replay runs the recorded step's ops in the recorded order (one rank, the
    recording's precision and CPU thread count, fp32)."""
    assert a.keys() == b.keys()
    assert not [k for k in a if not torch.equal(a[k], b[k])], [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("algo", ["tba", "areal"])
def test_replay_of_async_run_ends_on_its_weights(tmp_path, algo):
    cfg = _record_cfg(tmp_path, algo)
    train(cfg, make_algo(cfg), _prompts(), toy_reward, stop_token_ids=())
    run = Path(cfg.run_root) / cfg.name
    steps = list(read_steps(run / "stream"))
    assert [s.step for s in steps] == list(range(1, 7))
    assert all(s.finish_reasons and set(s.finish_reasons) <= {"stop", "length", "interrupted"} for s in steps)
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [s.stats["loss"] for s in steps] == [r["loss"] for r in rows]
    assert [s.lr for s in steps] == [cfg.train.lr] * 6  # one warm-up step, no decay
    assert all(r["record_bytes"] > 0 for r in rows)
    if algo == "tba":  # async TBA: the buffer mixes versions, so some rows are stale
        assert any(s.batch.versions.max() < s.version for s in steps)

    init = load_model(cfg.model, tokenizer=False)[0].state_dict()
    assert max((v - init[k]).abs().max().item() for k, v in _final_weights(run).items()) > 1e-3  # it trained
    last = replay(run / "stream", name="again")  # the recording's algorithm and config
    # same ops in the same order as the run's trainer (one rank, its precision and thread count): in
    # practice bit for bit; bounded by rounding relative to what the 6 steps moved (tests/close.py)
    assert_update_close(init, _final_weights(Path(cfg.run_root) / "again"), _final_weights(run), rel=1e-3)
    rep = [r for r in read_metrics(Path(cfg.run_root) / "again" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rep] == list(range(1, 7)) and last["version"] == steps[-1].version
    torch.testing.assert_close([r["loss"] for r in rep], [r["loss"] for r in rows], atol=1e-6, rtol=0)
    assert [r["staleness_hist"] for r in rep] == [r["staleness_hist"] for r in rows]
    assert (Path(cfg.run_root) / "again" / "curves.png").is_file() and (run / "replays.png").is_file()


def test_replay_under_other_losses_and_cli(tmp_path, capsys):
    cfg = _record_cfg(tmp_path, steps=3)
    train(cfg, make_algo(cfg), _prompts(), toy_reward, stop_token_ids=())
    run = Path(cfg.run_root) / cfg.name

    def my_loss(seq_logp, ref_seq_logp, reward, group_id, beta):  # a loss defined here, not in a module
        return -(reward * seq_logp).mean(), {"my_stat": 1.0}

    algo = lambda c: TBA(c.tba, c.train.prompts_per_step, c.gen.n, c.gen.temperature, c.train.micro_batch_tokens,
                         loss_fn=my_loss)
    replay(run, algo, name="mine")
    mine = [r for r in read_metrics(Path(cfg.run_root) / "mine" / "metrics.jsonl") if "loss" in r]
    assert len(mine) == 3 and all(r["my_stat"] == 1.0 for r in mine)
    with pytest.raises(FileExistsError, match="already holds a run"):
        replay(run, loss=my_loss, name="mine")
    replay(run, loss=my_loss, name="mine", overwrite=True, argv=["--train.steps=2"])  # the loss alone, one contract
    again = [r for r in read_metrics(Path(cfg.run_root) / "mine" / "metrics.jsonl") if "loss" in r]
    assert len(again) == 2 and all(r["my_stat"] == 1.0 for r in again)
    with pytest.raises(ValueError, match="mix with the recorded run"):  # overwrite never deletes the recording
        replay(run, name=cfg.name, overwrite=True)
    assert (run / "stream").is_dir()
    assert replay_main([str(run / "stream"), "--algo=grpo", "--name=g", "--train.steps=2"]) == 0
    grpo = [r for r in read_metrics(Path(cfg.run_root) / "g" / "metrics.jsonl") if "loss" in r]
    assert len(grpo) == 2 and "kl_seq" in grpo[0]
    assert json.loads((Path(cfg.run_root) / "g" / "config.json").read_text())["algo"] == "grpo"
    assert replay_config(run, ["--tba.beta_final=0.2"]).tba.beta_final == 0.2
    assert replay_main([str(tmp_path / "nowhere")]) == 2 and "not a recorded stream" in capsys.readouterr().err


def test_replay_runs_with_the_recorded_threads(tmp_path, monkeypatch):
    """The CPU thread count decides how a GEMM splits its sums: the stream records the trainer's,
    the replay runs with it (and ranks it spawns would), both give the caller's count back, and
    the caller's kernels too (the run applies its own precision: here SDPA, not our attention)."""
    monkeypatch.setenv("ASYNCRL_NUM_THREADS", "2")
    cfg = _record_cfg(tmp_path, steps=3)
    cfg.precision.attention, cfg.precision.gemm = "sdpa", "aten"
    caller = (kernel_enabled(), onednn_enabled())
    assert caller == (True, onednn_available())  # tests/conftest.py's defaults
    train(cfg, make_algo(cfg), _prompts(), toy_reward, stop_token_ids=())
    assert torch.get_num_threads() == 1  # tests/conftest.py's, restored
    assert (kernel_enabled(), onednn_enabled()) == caller
    run = Path(cfg.run_root) / cfg.name
    assert [seg["threads"] for seg in read_meta(run / "stream")["segments"]] == [2]
    monkeypatch.delenv("ASYNCRL_NUM_THREADS")
    seen = []

    class Watched(TBA):
        def backward(self, model, batch, step):
            seen.append((torch.get_num_threads(), os.environ.get("ASYNCRL_NUM_THREADS"),
                         kernel_enabled(), onednn_enabled()))
            return super().backward(model, batch, step)

    replay(run, lambda c: Watched(c.tba, c.train.prompts_per_step, c.gen.n, c.gen.temperature,
                                  c.train.micro_batch_tokens), name="again")
    assert seen == [(2, "2", False, False)] * 3  # the recording's precision, applied
    assert torch.get_num_threads() == 1 and "ASYNCRL_NUM_THREADS" not in os.environ
    assert (kernel_enabled(), onednn_enabled()) == caller
    _assert_same_weights(_final_weights(Path(cfg.run_root) / "again"), _final_weights(run))


def test_bad_streams_are_refused(tmp_path):
    cfg = _record_cfg(tmp_path, steps=2)
    train(cfg, make_algo(cfg), _prompts(), toy_reward, stop_token_ids=())
    stream = Path(cfg.run_root) / cfg.name / "stream"
    with pytest.raises(StreamError, match="not a recorded stream"):
        replay(tmp_path)
    save_hf("llama_tied", tmp_path / "other_model", seed=1)
    with pytest.raises(StreamError, match="not the model"):
        replay(stream, argv=[f"--model={tmp_path / 'other_model'}"], name="x")
    os.replace(step_file(stream, 1), stream / "elsewhere")
    with pytest.raises(StreamError, match=r"steps \[1\] are missing"):
        replay(stream, name="y")
    os.replace(stream / "elsewhere", step_file(stream, 1))
    step_file(stream, 2).write_bytes(step_file(stream, 2).read_bytes()[:100])  # truncated
    with pytest.raises(StreamError, match="corrupt step file"):
        replay(stream, name="z")


# ------------------------------------------------------------------ kill and resume
class DiesAtStep5(TBA):
    """Kills its process in the middle of trainer step 5 (after 4 recorded steps, checkpoint at 3)."""
    def backward(self, model, batch, step):
        if step == 4:
            os._exit(9)
        return super().backward(model, batch, step)


def killed_run(tmp: str) -> None:
    """Run in a child process by the test below."""
    cfg = _record_cfg(Path(tmp), checkpoint_every=3)
    cfg.train.steps = 8
    c = cfg.tba
    train(cfg, DiesAtStep5(c, cfg.train.prompts_per_step, cfg.gen.n, cfg.gen.temperature,
                           cfg.train.micro_batch_tokens), _prompts(), toy_reward, stop_token_ids=())


def test_stream_survives_kill_and_resume(tmp_path):
    out = subprocess.run([sys.executable, "-c", f"from tests.test_replay import killed_run; killed_run({str(tmp_path)!r})"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 9, out.stderr[-2000:]
    run = tmp_path / "runs" / "toy"
    assert [s.step for s in read_steps(run / "stream")] == [1, 2, 3, 4]  # whole up to the last completed step
    assert latest_checkpoint(run).name == "step_000003"
    (run / "stream" / ".tmp_step_000005.safetensors").write_bytes(b"half a step")  # as a crash mid-write leaves it

    cfg = _record_cfg(tmp_path)
    cfg.train.steps = 8
    train(cfg, make_algo(cfg), _prompts(), toy_reward, stop_token_ids=(), resume=True)
    assert [s.step for s in read_steps(run / "stream")] == list(range(1, 9))
    assert [p.name for p in (run / "stream" / "discarded").rglob("*.safetensors")] == ["step_000004.safetensors"]
    assert not list((run / "stream").glob(".tmp_*"))
    assert [s["start_step"] for s in read_meta(run / "stream")["segments"]] == [0, 3]
    replay(run, name="after_resume")  # steps 1-3 ran in another process: the same bits all the same
    _assert_same_weights(_final_weights(tmp_path / "runs" / "after_resume"), _final_weights(run))


def test_record_needs_the_stream_from_step_1(tmp_path):
    cfg = _record_cfg(tmp_path, checkpoint_every=2)
    cfg.train.steps, cfg.train.record = 2, False
    train(cfg, make_algo(cfg), _prompts(), toy_reward, stop_token_ids=())
    cfg.train.steps, cfg.train.record = 4, True
    with pytest.raises(StreamError, match="must start at step 1"):
        train(cfg, make_algo(cfg), _prompts(), toy_reward, stop_token_ids=(), resume=True)


def test_replay_on_two_trainer_ranks(tmp_path):
    cfg = _record_cfg(tmp_path, steps=3)
    train(cfg, make_algo(cfg), _prompts(), toy_reward, stop_token_ids=())
    run = Path(cfg.run_root) / cfg.name
    replay(run, argv=["--train.trainer_devices=2"], name="two_ranks")
    # sharded sums run in another order: equal to one rank up to rounding, relative to what the
    # 3 steps moved each tensor (tests/close.py; as tests/test_ranks.py)
    init = load_model(cfg.model, tokenizer=False)[0].state_dict()
    assert_update_close(init, _final_weights(Path(cfg.run_root) / "two_ranks"), _final_weights(run), msg="2 ranks vs 1")
