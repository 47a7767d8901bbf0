"""`--train.max_staleness=auto` in a real run (common/runtime/staleness_control.py, wired in
common/runtime/trainer.py): a waiting trainer raises eta, sick importance weights lower it without
dropping a row admitted under the higher bound, the decisions are in the metrics, and a resumed run
continues with the controller's state from the checkpoint."""
import json
import time

import pytest
import torch

from areal.algo import AReaL, AReaLConfig
from common.contracts.batch import Trajectory
from common.contracts.config import ConfigError
from common.contracts.log import read_metrics
from common.contracts.plots import plot_runs
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.generator import Control
from common.runtime.train_config import TrainConfig, check_config, filter_staleness
from common.train import train
from tests.test_e2e import _cfg, _prompts, toy_reward


def slow_reward(tokens, meta) -> float:
    """The toy reward, slowly: generation takes longer than training, so the trainer waits."""
    time.sleep(0.03)
    return toy_reward(tokens, meta)


class SickAReaL(AReaL):
    """Reports collapsed importance weights from step `sick_from` on (the controller reads only the stats)."""
    sick_from = 0

    def backward(self, model, batch, step):
        st = super().backward(model, batch, step)
        return {**st, "behav_ess": 0.1} if step >= self.sick_from else st


def _auto_cfg(tmp_path, **kw):
    cfg = _cfg(tmp_path, sync_every=1, max_staleness="auto", lr=1e-3, **kw)
    cfg.algo, cfg.gen.update_mode, cfg.gen.ref_logp = "areal", "interrupt", False
    return cfg


def _algo(cfg, cls=AReaL):
    t = check_config(cfg.train)
    return cls(AReaLConfig(), t.prompts_per_step, cfg.gen.n, cfg.gen.temperature, t.micro_batch_tokens,
               max_staleness=filter_staleness(t))


def _rows(cfg):
    return [r for r in read_metrics(f"{cfg.run_root}/{cfg.name}/metrics.jsonl") if "staleness_hist" in r]


def test_config_takes_auto_and_refuses_it_where_it_cannot_act():
    t = check_config(TrainConfig(max_staleness="auto", max_staleness_max=4))
    assert t.max_staleness == "auto" and filter_staleness(t) == 4  # the filter keeps the ceiling
    assert filter_staleness(check_config(TrainConfig(max_staleness=2))) == 2
    with pytest.raises(ConfigError, match="auto needs --train.mode=async"):
        check_config(TrainConfig(max_staleness="auto", mode="sync"))
    with pytest.raises(ConfigError, match="lr_by_ess"):
        check_config(TrainConfig(max_staleness=2, lr_by_ess=True))
    with pytest.raises(ConfigError, match="max_staleness=-1"):
        check_config(TrainConfig(max_staleness=-1))


def test_lowering_the_bound_pauses_admission_and_never_drops_an_admitted_row():
    """Rows started under eta = 4 are still trained after the bound drops to 0: the quota pauses
    claims, and AReaL's filter (at the ceiling under auto) takes them."""
    import threading
    P, n = 2, 2
    c = Control(threading, P, 4)
    started = [c.claim() for _ in range(5 * P)]  # (eta + v + 1) x P = 10 prompts at v = 0
    assert None not in started and c.claim() is None
    buf = ReplayBuffer(64, 16, pad_id=0)
    for g in range(5 * P):  # every admitted prompt's group, drawn by version 0
        buf.add([Trajectory(prompt=torch.tensor([3, 4]), completion=torch.tensor([5, 6]),
                            logp=torch.tensor([-1.0, -1.0]), versions=torch.tensor([0, 0]), reward=float(i), group_id=g)
                 for i in range(n)])
    for v in range(1, 5):  # the trainer moves to version 4 while the bound drops to 0
        c.set_version(v)
    c.set_bound(0)
    assert c.claim() is None  # 10 started >= (0 + 4 + 1) x 2: paused, nothing withdrawn
    t = check_config(TrainConfig(max_staleness="auto", prompts_per_step=P, buffer_capacity=64))
    algo = AReaL(AReaLConfig(), P, n, 1.0, 256, max_staleness=filter_staleness(t))
    taken = [algo.next_batch(buf, step=0, version=4, sync=False) for _ in range(5)]
    assert all(b is not None and len(b.reward) == P * n for b in taken)  # every row trained, 4 versions old
    assert buf.n_dropped_stale == 0


def test_a_waiting_trainer_raises_eta_sick_weights_lower_it_and_no_row_is_dropped(tmp_path):
    SickAReaL.sick_from = 14
    cfg = _auto_cfg(tmp_path, steps=28)
    train(cfg, _algo(cfg, SickAReaL), _prompts(), slow_reward, stop_token_ids=())
    rows = _rows(cfg)
    etas = [r["eta"] for r in rows]
    assert etas[0] == 1 and max(etas[:14]) >= 2, etas  # raised while waiting with healthy weights
    assert all(r["eta_wait"] > 0.2 for r in rows[4:14] if r["eta"] > rows[0]["eta"])
    peak = max(etas)
    assert etas[-1] < peak, etas  # the sick weights (ESS 0.1 from step 15) lowered it
    assert all(k in rows[-1] for k in ("eta_ess", "eta_capped", "eta_wait"))
    assert all(r["dropped_stale"] == 0 for r in rows)  # lowering only paused admission
    B = cfg.train.prompts_per_step
    bound = [max(etas[:i + 1]) for i in range(len(etas))]  # the highest eta any admission saw so far
    assert all(r["prompts_started"] <= (b + r["version"] + 1) * B for r, b in zip(rows, bound))
    fig = plot_runs([f"{cfg.run_root}/{cfg.name}"])  # curves.png's panels: eta and its ESS drawn
    titles = [ax.get_title() for ax in fig.axes]
    assert "staleness bound eta (auto)" in titles and "ESS fraction (auto's window)" in titles, titles


def test_auto_resumes_with_the_controllers_state(tmp_path):
    """A waiting trainer raises eta at steps 5 and 10 (hold 4): cut at step 6 and resumed, the run
    keeps eta 2 and its hold count, and raises at step 10 as an uninterrupted run does."""
    cfg = _auto_cfg(tmp_path, steps=6, checkpoint_every=6)
    train(cfg, _algo(cfg), _prompts(), slow_reward, stop_token_ids=())
    ck = sorted((tmp_path / "runs" / "toy" / "checkpoints").glob("step_*"))[-1]
    counters = json.loads((ck / "meta.json").read_text())["counters"]
    assert counters["staleness.eta"] == 2 and counters["staleness.since_change"] == 1
    cfg.train.steps = 11
    train(cfg, _algo(cfg), _prompts(), slow_reward, stop_token_ids=(), resume=True)
    rows = {r["step"]: r for r in _rows(cfg)}
    assert [rows[s]["eta"] for s in (4, 5, 6, 7, 9, 10, 11)] == [1, 2, 2, 2, 2, 3, 3], rows


def test_lr_by_ess_scales_the_rate_by_the_root_of_the_ess(tmp_path):
    SickAReaL.sick_from = 0  # ESS 0.1 every step: lr x sqrt(0.1)
    cfg = _auto_cfg(tmp_path, steps=3, lr_by_ess=True, warmup_steps=0)
    train(cfg, _algo(cfg, SickAReaL), _prompts(), toy_reward, stop_token_ids=())
    rows = _rows(cfg)
    assert all(r["lr_scale"] == pytest.approx(0.1 ** 0.5) for r in rows)
    assert all(r["lr"] == pytest.approx(1e-3 * 0.1 ** 0.5) for r in rows)  # the rate the next update runs at
