"""Judge the staleness controller (`auto`, `auto+lr`) against every fixed eta on the simulated
clock (bench/async_sim.py): the same trainer steps per arm, deterministic per seed, three settings
that want different etas. Run by `python bench/staleness.py --auto` (or this file directly); prints
one JSON line, writes a plot.

Arms: eta in FIXED, `auto` (eta from `StalenessController(ControlSettings(ceiling=8))`, the filter
at the ceiling), `auto+lr` (the same, lr = base x `lr_scale()`); the controller is untuned: its
defaults in every setting. Figures per setting and arm, over seeds:
  final         the final policy's evaluated (exact expected) reward; mean, 95% bootstrap CI.
  equal time    T_eq(seed) = the earliest time any arm of that setting and seed finishes its
                steps; an arm's reward at T_eq is that of the last weights it published by then.
  threshold     r0 + 0.75 (best fixed final - r0), r0 the initial reward: the first simulated time an
                arm's evaluated reward reaches it (mean over the seeds that reach it, and how many).
  collapse      a run whose last COLLAPSE_TAIL evaluations are all more than COLLAPSE_MARGIN below
                its own best evaluation.
Normalised score (the worst case): an arm's mean reward at equal time / the best fixed eta's (the
fixed arm with the highest mean reward at equal time) in that setting; worst over settings.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.async_sim import SimConfig, run_arm  # noqa: E402
from common.evaluate import bootstrap_mean  # noqa: E402

FIXED = [0, 1, 2, 4, 8]
ARMS = FIXED + ["auto", "auto+lr"]
# chosen from the fixed arms alone (what each wants at equal time): large eta / 0-1 / 1 / 0
SETTINGS = {
    "gen_bound": dict(loss="decoupled", lr=1e-2, train_c0=10.0, train_c1=0.02),
    "naive_big_lr": dict(loss="naive", lr=3e-2, train_c0=60.0, train_c1=0.05),
    "train_bound_big_lr": dict(loss="decoupled", lr=2e-2, train_c0=40.0, train_c1=0.05),
    "naive_train_bound": dict(loss="naive", lr=3e-2, train_c0=150.0, train_c1=0.05),
}
COLLAPSE_MARGIN, COLLAPSE_TAIL, THRESHOLD_FRAC = 0.1, 5, 0.75
BOOT = 2000  # bootstrap resamples of a mean over seeds (95% percentile interval, fixed resampling seed)


def reward_at(evals: list, t: float) -> float:
    """The evaluated reward of the last weights published at or before t."""
    return evals[bisect.bisect_right([e[0] for e in evals], t) - 1][2]


def collapsed(evals: list) -> bool:
    r = [e[2] for e in evals]
    return len(r) > COLLAPSE_TAIL and all(x < max(r) - COLLAPSE_MARGIN for x in r[-COLLAPSE_TAIL:])


def judge_setting(cfg: SimConfig, seeds: list[int]) -> tuple[dict, dict]:
    """Every arm x seed of one setting -> (figures, the raw runs for the plot)."""
    runs = {a: [run_arm(cfg, a, s) for s in seeds] for a in ARMS}
    t_eq = [min(runs[a][i]["end_time"] for a in ARMS) for i in range(len(seeds))]
    r0 = float(np.mean([r["initial_reward"] for r in runs[0]]))
    arms = {}
    for a in ARMS:
        rs = runs[a]
        fin, eq = [r["final_reward"] for r in rs], [reward_at(r["evals"], t_eq[i]) for i, r in enumerate(rs)]
        arms[str(a)] = {"final": float(np.mean(fin)), "final_ci": list(bootstrap_mean(fin, BOOT)),
                        "equal_time": float(np.mean(eq)), "equal_time_ci": list(bootstrap_mean(eq, BOOT)),
                        "end_time": float(np.mean([r["end_time"] for r in rs])),
                        "collapses": sum(collapsed(r["evals"]) for r in rs),
                        "stalled": sum(r["stalled"] for r in rs), "dropped": sum(r["dropped"] for r in rs),
                        "staleness_mean": float(np.mean([r["staleness_mean"] for r in rs])),
                        "staleness_max": max(r["staleness_max"] for r in rs),
                        "ess_mean": float(np.mean([np.mean([x["behav_ess"] for x in r["rows"]]) for r in rs])),
                        "wait_share_mean": float(np.mean([np.mean([x["wait_share"] for x in r["rows"]]) for r in rs]))}
        if isinstance(a, str):
            etas = np.array([[x["eta"] for x in r["rows"]] for r in rs], dtype=float)
            arms[str(a)].update(eta_mean=float(etas.mean()), eta_by_step=[round(float(e), 2) for e in etas.mean(0)],
                                eta_last=[int(e) for e in etas[:, -1]])
    best = max(FIXED, key=lambda e: arms[str(e)]["final"])
    best_eq = max(FIXED, key=lambda e: arms[str(e)]["equal_time"])
    thr = r0 + THRESHOLD_FRAC * (arms[str(best)]["final"] - r0)
    for a in ARMS:
        hit = [next((t for t, _, r in run["evals"] if r >= thr), None) for run in runs[a]]
        reached = [t for t in hit if t is not None]
        arms[str(a)].update(time_to_threshold=float(np.mean(reached)) if reached else None, reached=len(reached),
                            score=arms[str(a)]["equal_time"] / arms[str(best_eq)]["equal_time"])
    out = {"initial_reward": r0, "threshold": thr, "t_equal_mean": float(np.mean(t_eq)),
           "best_fixed_eta": best, "best_fixed_final": arms[str(best)]["final"],
           "best_fixed_final_ci": arms[str(best)]["final_ci"],
           "best_fixed_eta_at_equal_time": best_eq, "best_fixed_at_equal_time": arms[str(best_eq)]["equal_time"]}
    for a, k in (("auto", "auto"), ("auto+lr", "auto_lr")):
        out[f"{k}_final"] = arms[a]["final"]
        out[f"{k}_within_ci"] = arms[a]["final"] >= arms[str(best)]["final_ci"][0]
        out[f"{k}_over_best_at_equal_time"] = arms[a]["score"]
    out["arms"] = arms
    return out, {"runs": runs, "t_eq": t_eq}


def plot(results: list, raw: list, png: str) -> str | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 3.0 * len(results)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), 2, squeeze=False)
    for (ax, ax_eta), res, rw in zip(axes, results, raw):
        for a in ARMS:
            rs = rw["runs"][a]
            grid = np.linspace(0, min(r["end_time"] for r in rs), 120)
            curve = np.mean([[reward_at(r["evals"], t) for t in grid] for r in rs], 0)
            ax.plot(grid, curve, lw=2.2 if isinstance(a, str) else 1.2, ls="-" if isinstance(a, int) else "--",
                    label=f"eta {a}" if isinstance(a, int) else a)
            if a == "auto":
                for r in rs:
                    ax_eta.step([0] + [x["time"] for x in r["rows"]], [r["rows"][0]["eta"]] +
                                [x["eta_next"] for x in r["rows"]], where="post", color="C5", alpha=0.25, lw=0.8)
        ax.axvline(float(np.mean(rw["t_eq"])), color="k", lw=0.6, ls=":")
        ax.set(title=f"{res['name']}: reward, mean of seeds (dotted: equal time)",
               xlabel="simulated time", ylabel="reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        ax_eta.set(title=f"{res['name']}: auto's eta, one line per seed", xlabel="simulated time", ylabel="eta",
                   ylim=(-0.3, 8.3))
        ax_eta.grid(alpha=0.3)
    fig.savefig(png, dpi=60)
    return png


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=32, help="seeds per setting and arm (0 .. N-1)")
    ap.add_argument("--steps", type=int, default=60, help="trainer steps per arm")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--png", default=None, help="plot path (default: staleness_auto_sim.png in the temp dir)")
    ap.add_argument("--quick", action="store_true", help="2 seeds, 12 steps: a smoke run")
    a = ap.parse_args(argv)
    if a.quick:
        a.seeds, a.steps = 2, 12
    torch.set_num_threads(1)
    seeds, t0 = list(range(a.seeds)), time.perf_counter()
    results, raw = [], []
    for name in a.settings:
        res, rw = judge_setting(SimConfig(steps=a.steps, **SETTINGS[name]), seeds)
        results.append({"name": name, **SETTINGS[name], **res})
        raw.append(rw)
        print(f"{name}: best fixed {res['best_fixed_eta']} final {res['best_fixed_final']:.3f}, auto "
              f"{res['auto_final']:.3f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    worst = {str(x): min(r["arms"][str(x)]["score"] for r in results) for x in ARMS}
    fixed_worst = max(worst[str(e)] for e in FIXED)
    png = plot(results, raw, a.png or os.path.join(os.environ.get("TMPDIR", "/tmp"), "staleness_auto_sim.png"))
    out = {"bench": "staleness_auto_sim", "seeds": a.seeds, "steps": a.steps, "arms": [str(x) for x in ARMS],
           "sim": {k: v for k, v in vars(SimConfig()).items() if k not in ("loss", "lr", "steps")},
           "score": "reward at equal time / the setting's best fixed eta's at equal time",
           "worst_score": worst,
           "auto_worst_case_beats_every_fixed": worst["auto"] > fixed_worst,
           "auto_lr_worst_case_beats_every_fixed": worst["auto+lr"] > fixed_worst,
           "targets": {k: {"final_within_ci_everywhere": all(r[f"{k}_within_ci"] for r in results),
                           "equal_time_at_least_0.9_everywhere": all(r[f"{k}_over_best_at_equal_time"] >= 0.9
                                                                      for r in results)}
                       for k in ("auto", "auto_lr")},
           "settings": results, "plot": png, "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
