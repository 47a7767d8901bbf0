"""End to end on a toy task: spawned generator, shared buffer and weights, TBA trainer.

Toy task: the reward of a completion is the fraction of its tokens below LOW (ids 0..LOW-1). A
tiny random model starts near LOW/V ~ 0.2; trajectory balance towards pi_ref * exp(r / beta) must
raise it.
"""
import re

import pytest
import torch

from common.contracts.batch import PromptSet
from common.engine.machine.precision import PrecisionConfig
from common.contracts.log import read_metrics
from common.runtime.generator import GenConfig
from common.runtime.train_config import TrainConfig
from common.task import RunConfig
from common.train import train
from tba.algo import GRPO, TBA, GRPOConfig, TBAConfig
from tests.tiny import save_hf

LOW = 20


def toy_reward(tokens, meta) -> float:
    """tokens: list of ids (tiny checkpoints have no tokenizer, so rewards see ids)."""
    return sum(t < LOW for t in tokens) / max(1, len(tokens))


def flaky_reward(tokens, meta) -> float:
    if tokens and tokens[0] % 5 == 0:
        raise RuntimeError("grader crashed on this sample")
    return toy_reward(tokens, meta)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return PromptSet([torch.randint(10, 90, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (16,), generator=g)])


def _cfg(tmp_path, **train_kw):
    save_hf("llama_tied", tmp_path / "model")
    cfg = RunConfig(name="toy", model=str(tmp_path / "model"), run_root=str(tmp_path / "runs"),
                    gen=GenConfig(max_batch=16, max_new_tokens=6, n=4, temperature=1.0),
                    train=TrainConfig(steps=100, lr=3e-3, warmup_steps=1, prompts_per_step=4, sync_every=2,
                                      min_buffer=16, buffer_capacity=512, micro_batch_tokens=256),
                    # fp32 everywhere so results do not depend on whether this CPU has bf16 units (bf16: tests/test_precision.py)
                    precision=PrecisionConfig(dtype="fp32"))
    for k, v in train_kw.items():
        setattr(cfg.train, k, v)
    return cfg


def _tba(cfg, beta=0.1):
    t = TBAConfig(beta_init=beta, beta_final=beta, m=0.5)
    return TBA(t, cfg.train.prompts_per_step, cfg.gen.n, cfg.gen.temperature, cfg.train.micro_batch_tokens)


def _reward_curve(cfg):
    rows = read_metrics(f"{cfg.run_root}/{cfg.name}/metrics.jsonl")
    return [r["reward_mean"] for r in rows if "reward_mean" in r]


def _policy_reward(model_dir, prompts, cfg) -> float:
    """Mean toy reward of 4 x 16 fresh samples from a checkpoint (measures the policy, not the buffer)."""
    from common.engine.checkpoints.hf_io import load_model
    from common.engine.sampler.sampler import Sampler
    from common.engine.sampler.sampling import SamplingParams
    m = load_model(str(model_dir), tokenizer=False)[0]
    outs = Sampler(m, max_batch=64, max_seq_len=32).generate(
        prompts.tokens, SamplingParams(max_new_tokens=cfg.gen.max_new_tokens, temperature=1.0, n=4, seed=1))
    return sum(toy_reward(c.tokens, None) for c in outs) / len(outs)


def test_async_tba_raises_reward(tmp_path):
    from common.engine.checkpoints.hf_io import load_model
    cfg = _cfg(tmp_path)
    before = {k: v.clone() for k, v in load_model(cfg.model, tokenizer=False)[0].state_dict().items()}
    last = train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    assert len(_reward_curve(cfg)) == 100 and last["version"] == 50
    final_dir = sorted((tmp_path / "runs" / "toy" / "checkpoints").glob("step_*"))[-1] / "model"
    r0, r1 = _policy_reward(cfg.model, _prompts(), cfg), _policy_reward(final_dir, _prompts(), cfg)
    print(f"policy reward before {r0:.3f} after {r1:.3f}")
    assert r0 < 0.35 and r1 > r0 + 0.3, (r0, r1)
    trained = load_model(str(final_dir), tokenizer=False)[0]
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)  # every parameter moved


def test_sync_mode_is_on_policy(tmp_path):
    cfg = _cfg(tmp_path, mode="sync", steps=6)
    train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    rows = [r for r in read_metrics(f"{cfg.run_root}/toy/metrics.jsonl") if "staleness_hist" in r]
    assert len(rows) == 6
    assert all(r["staleness_hist"] == {"0": 16} for r in rows)  # every token from the current weights
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_grpo_baseline_and_failing_reward_runs(tmp_path, capfd):
    cfg = _cfg(tmp_path, mode="sync", steps=4)
    algo = GRPO(GRPOConfig(), cfg.train.prompts_per_step, cfg.gen.n, cfg.gen.temperature, cfg.train.micro_batch_tokens)
    last = train(cfg, algo, _prompts(), flaky_reward, stop_token_ids=())
    assert last["reward_errors"] > 1  # scored 0 and counted, the run went on
    assert torch.isfinite(torch.tensor(last["loss"]))
    # the generator logged the first failure with its traceback, and only that one; the run ended
    # with a warning that counts them all (also those scored after the last step's row)
    err = capfd.readouterr().err
    assert err.count("RuntimeError: grader crashed on this sample") == 1 and "Traceback" in err and "in flaky_reward" in err
    total = int(re.search(r"\[asyncrl\] warning: (\d+) rewards raised or were not finite and scored "
                          r"gen.error_reward = 0 ", err).group(1))
    assert total >= last["reward_errors"]


def test_resume_continues_counters_buffer_and_metrics(tmp_path):
    from common.engine.checkpoints.hf_io import load_model
    from common.runtime.files.checkpoint import latest_checkpoint, load_checkpoint
    cfg = _cfg(tmp_path, steps=6, checkpoint_every=3)
    train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    run = tmp_path / "runs" / "toy"
    ck6 = latest_checkpoint(run)
    assert ck6.name == "step_000006"
    model = load_model(cfg.model, tokenizer=False)[0]
    opt = torch.optim.AdamW(model.parameters())
    st = load_checkpoint(ck6, model, opt)
    assert (st.step, st.version) == (6, 3) and st.buffer is not None and st.config["train"]["steps"] == 6
    n_before = st.buffer.n_added
    # "interrupted" after 6 steps; continue to 10 with --resume
    cfg.train.steps = 10
    last = train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=(), resume=True)
    assert last["version"] == 5
    st2 = load_checkpoint(latest_checkpoint(run), model, opt)
    assert (st2.step, st2.version) == (10, 5)
    assert st2.buffer.n_added >= n_before  # the restored buffer (plus whatever was generated since)
    old_rows = st.buffer.get(list(range(min(8, len(st.buffer)))))
    assert torch.equal(st2.buffer.get(list(range(min(8, len(st.buffer))))).tokens, old_rows.tokens) or st2.buffer.n_added > st2.buffer.capacity
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert steps == list(range(1, 11))


def test_resume_without_checkpoint_and_corrupt_checkpoint(tmp_path):
    from common.runtime.files.checkpoint import CheckpointError
    cfg = _cfg(tmp_path, steps=2)
    train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    ck = tmp_path / "runs" / "toy" / "checkpoints" / "step_000002"
    (ck / "trainer_state.pt").write_bytes(b"garbage")
    cfg.train.steps = 4
    with pytest.raises(FileExistsError, match="--resume"):  # never append to an existing run silently
        train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    with pytest.raises(CheckpointError, match="trainer_state"):
        train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=(), resume=True)


def make_toy_batched_reward():
    """Factory run once inside each reward worker (stands in for loading a reward model)."""
    def fn(texts, metas):
        if any(t and t[0] % 7 == 0 for t in texts):
            raise RuntimeError("reward model choked on one sample")
        return [toy_reward(t, m) for t, m in zip(texts, metas)]
    return fn


def test_reward_workers(tmp_path):
    cfg = _cfg(tmp_path, steps=4, reward_workers=2, mode="sync")
    last = train(cfg, _tba(cfg), _prompts(), None, stop_token_ids=(), reward_factory=make_toy_batched_reward)
    assert 0 < last["reward_mean"] < 1 and last["version"] == 4
    assert last["reward_errors"] > 0  # failing samples scored 0 one by one, the run went on
    with pytest.raises(ValueError, match="reward_factory"):
        train(_cfg(tmp_path / "b", reward_workers=1), _tba(cfg), _prompts(), None, stop_token_ids=())


def test_cuda_graphs_asked_for_on_a_cpu_run_is_refused_before_anything_starts(tmp_path):
    cfg = _cfg(tmp_path, steps=1)
    cfg.gen.cuda_graphs = True
    with pytest.raises(ValueError, match="gen.cuda_graphs needs CUDA"):
        train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=())
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
