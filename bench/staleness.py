"""AReaL's staleness ablation at CPU scale (the paper's Table 2 / Fig. 5): for each eta, decoupled
PPO vs naive PPO, same trainer steps, same seeds. Prints one JSON line and writes a plot.

Task (why this one): a small random Llama (vocab 512, 4 layers, d = 256, 3.6M parameters) learns
to emit tokens from a target set (ids below LOW = 64; the reward is the fraction of completion
tokens in it, ~LOW/V = 12.5% at the start). It is a real RL signal that a policy climbs from ~0.12 to ~1 within a few
dozen AReaL steps on one core, so 20+ runs fit in well under an hour on 2 cores, and a large
learning rate moves the policy far in one step, which is what makes stale data off-policy. The
default SmolLM2 model was not used: it solves ~4% of sampled 2-digit additions, too weak a
signal for runs of a few minutes.

Per run (one generator process + the trainer, `common.train.train`): eta = 0 is synchronous
AReaL (`train.mode=sync`); eta > 0 is asynchronous with k = 1 and interruptible generation.
Reported per (loss, eta), mean over seeds: final train reward (mean of the last 5 steps'
batches), final policy reward (fresh samples of the final weights, 16 prompts x 16), wall-clock,
trainer throughput (trained tokens / wall-clock) and the mean |prox - behav| gap.

    python bench/staleness.py                      # etas 0 1 2 4 8, 3 seeds, 60 steps (~12 min)
    python bench/staleness.py --quick              # etas 0 2, 1 seed, 6 steps (smoke check)
    python bench/staleness.py --auto [--seeds N]   # the controller (auto) vs every fixed eta on a
                                                   # simulated clock (bench/staleness_judge.py)
    python bench/staleness.py --preset areal_eta --random_weights --etas 0 1 2 4 8 16 \
        --set train.steps=20                       # AReaL's own ablation setup (run_gsm8k.py --preset=areal_eta:
                                                   # R1-Distill-Qwen-1.5B, 512 x 16, 8,192 tokens) on a GPU

With --preset, each (loss, eta) is a run of `run_gsm8k.py --preset=<preset>` (eta 0 in lock-step,
`train.mode=sync`), naive PPO through `main(loss=ppo_loss)`, every `--set key=value` passed on as
`--key=value` (a GPU's budget: fewer steps, a shorter evaluation); reported per run: its steps, the
mean reward of its last steps, its last evaluation, the mean step time and trained tokens per
second, the staleness and the behaviour-weight gap. `--random_weights` runs it without the hub.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.contracts.batch import PromptSet  # noqa: E402
from common.engine.machine.precision import PrecisionConfig
from common.runtime.generator import GenConfig  # noqa: E402
from common.runtime.train_config import TrainConfig  # noqa: E402
from common.task import RunConfig  # noqa: E402

LOW, VOCAB = 64, 512


def reward_fn(tokens, meta) -> float:
    """Fraction of completion tokens below LOW (the checkpoint has no tokenizer: ids, not text)."""
    return sum(t < LOW for t in tokens) / max(1, len(tokens))


def make_model(path: str) -> None:
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def prompts(n: int = 32) -> PromptSet:
    g = torch.Generator().manual_seed(0)
    return PromptSet([torch.randint(LOW, VOCAB, (int(k),), generator=g).tolist()
                      for k in torch.randint(2, 7, (n,), generator=g)])


@torch.no_grad()
def policy_reward(model_dir: str, max_new: int) -> float:
    from common.engine.checkpoints.hf_io import load_model
    from common.engine.sampler.sampler import Sampler
    from common.engine.sampler.sampling import SamplingParams
    m = load_model(model_dir, tokenizer=False)[0]
    ps = prompts().tokens[:16]
    outs = Sampler(m, max_batch=256, max_seq_len=8 + max_new).generate(
        ps, SamplingParams(max_new_tokens=max_new, temperature=1.0, n=16, seed=123))
    return statistics.mean(reward_fn(c.tokens, None) for c in outs)


def run_one(a, model_dir: str, root: str, loss_name: str, eta: int, seed: int) -> dict:
    from areal.algo import AReaL, AReaLConfig
    from areal.loss import decoupled_ppo_loss, ppo_loss
    from common.contracts.log import read_metrics
    from common.train import train
    name = f"{loss_name}_eta{eta}_s{seed}"
    cfg = RunConfig(name=name, run_root=root, model=model_dir, seed=seed,
                      gen=GenConfig(max_batch=a.prompts * a.n, max_new_tokens=a.max_new, n=a.n, temperature=1.0,
                                    update_mode="interrupt", ref_logp=False),
                      train=TrainConfig(steps=a.steps, lr=a.lr, warmup_steps=1, prompts_per_step=a.prompts,
                                        sync_every=1, mode="sync" if eta == 0 else "async", max_staleness=eta,
                                        min_buffer=a.prompts * a.n, buffer_capacity=(eta + 4) * a.prompts * a.n,
                                        micro_batch_tokens=4096, keep_checkpoints=1),
                    precision=PrecisionConfig(dtype="fp32"))  # results independent of the CPU's bf16 units
    loss_fn = {"decoupled": decoupled_ppo_loss, "naive": ppo_loss}[loss_name]
    algo = AReaL(AReaLConfig(n_minibatches=4), a.prompts, a.n, 1.0, 4096, max_staleness=eta, loss_fn=loss_fn)
    torch.manual_seed(seed)
    t = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
        train(cfg, algo, prompts(), reward_fn, stop_token_ids=())
    wall = time.perf_counter() - t
    rows = [r for r in read_metrics(os.path.join(root, name, "metrics.jsonl")) if "step_s" in r]
    final = sorted(os.listdir(os.path.join(root, name, "checkpoints")))[-1]
    tokens = sum(r["trainer_tok_s"] * r["train_s"] for r in rows)  # trained completion tokens
    return {"loss": loss_name, "eta": eta, "seed": seed, "wall_s": wall,
            "steps_s": sum(r["step_s"] for r in rows),
            "train_reward": statistics.mean(r["reward_mean"] for r in rows[-5:]),
            "steps_to_0.9": next((r["step"] for r in rows if r["reward_mean"] >= 0.9), None),
            "policy_reward": policy_reward(os.path.join(root, name, "checkpoints", final, "model"), a.max_new),
            "trainer_tok_per_s": tokens / sum(r["step_s"] for r in rows),
            "gap_mean": statistics.mean(r["gap_mean"] for r in rows),
            "staleness_mean": statistics.mean(r["staleness_mean"] for r in rows),
            "dropped_stale": rows[-1]["dropped_stale"]}


def plot(summary: dict, etas: list[int], out_png: str) -> str | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for ax, key, title in zip(axes, ("policy_reward", "train_reward", "trainer_tok_per_s"),
                              ("final policy reward", "train reward (last 5 steps)", "trainer tokens / s (wall)")):
        for loss in ("decoupled", "naive"):
            pts = [(e, summary[f"{loss}_eta{e}"]) for e in etas if f"{loss}_eta{e}" in summary]
            ax.errorbar([p[0] for p in pts], [p[1][key] for p in pts], yerr=[p[1][key + "_sd"] for p in pts],
                        marker="o", capsize=3, label=loss)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(etas, [str(e) for e in etas])
        ax.set_xlabel("max staleness eta")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("AReaL staleness ablation (toy task, tiny Llama, CPU)")
    fig.savefig(out_png, dpi=100)
    return out_png


def preset_sweep(a) -> dict:
    """Each (loss, eta) as a run of run_gsm8k.py's preset (module docstring); returns the JSON line."""
    import run_gsm8k
    from areal.loss import decoupled_ppo_loss, ppo_loss
    from common.contracts.log import read_metrics
    root, runs = a.root or tempfile.mkdtemp(prefix="asyncrl_staleness_"), []
    for eta in a.etas:
        for loss_name, loss_fn in (("decoupled", decoupled_ppo_loss), ("naive", ppo_loss)):
            if eta == 0 and loss_name == "naive":
                continue  # lock-step: every token on-policy, the two losses are one (AReaL's table: one row)
            name = f"{a.preset}_{loss_name}_eta{eta}"
            argv = [f"--preset={a.preset}", f"--name={name}", f"--run_root={root}", "--overwrite",
                    *(["--train.mode=sync"] if eta == 0 else [f"--train.max_staleness={eta}"]),
                    *(["--random_weights"] if a.random_weights else []), *(f"--{kv}" for kv in a.set)]
            t = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
                last = run_gsm8k.main(argv, loss=loss_fn)
            rows = read_metrics(os.path.join(root, name, "metrics.jsonl"))
            steps = [r for r in rows if "step_s" in r]
            evals = [r for r in rows if "eval_accuracy" in r]
            runs.append({"loss": loss_name, "eta": eta, "wall_s": round(time.perf_counter() - t, 1),
                         "steps": len(steps), "train_reward": statistics.mean(r["reward_mean"] for r in steps[-5:]),
                         "eval_accuracy": evals[-1]["eval_accuracy"] if evals else None,
                         "step_s": statistics.mean(r["step_s"] for r in steps),
                         "trainer_tok_per_s": statistics.mean(r.get("trainer_tok_s", 0.0) for r in steps),
                         "staleness_mean": statistics.mean(r["staleness_mean"] for r in steps),
                         "gap_mean": statistics.mean(r.get("gap_mean", 0.0) for r in steps),
                         "version": last.get("version")})
            print(json.dumps({"run": runs[-1]}), file=sys.stderr)
    return {"bench": "staleness", "preset": a.preset, "random_weights": a.random_weights, "set": a.set,
            "etas": a.etas, "runs": runs, "root": root}


def main():
    if "--auto" in sys.argv[1:]:  # a different benchmark: its own arguments (bench/staleness_judge.py)
        from bench.staleness_judge import main as judge
        judge([x for x in sys.argv[1:] if x != "--auto"])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--root", default=None, help="run directory root (default: a temp dir)")
    ap.add_argument("--png", default=None, help="plot path (default: <root>/staleness.png)")
    ap.add_argument("--quick", action="store_true", help="etas 0 2, one seed, 6 steps")
    ap.add_argument("--auto", action="store_true", help="judge the staleness controller instead (simulated clock; "
                    "see bench/staleness_judge.py --help)")
    ap.add_argument("--preset", default=None, help="sweep run_gsm8k.py's preset instead of the toy task (areal_eta)")
    ap.add_argument("--random_weights", action="store_true", help="--preset: random models of the published shapes")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="--preset: passed on as --KEY=VALUE")
    a = ap.parse_args()
    if a.preset:
        print(json.dumps(preset_sweep(a)))
        return
    if a.quick:
        a.etas, a.seeds, a.steps = [0, 2], [0], 6
    torch.set_num_threads(1)
    root = a.root or tempfile.mkdtemp(prefix="asyncrl_staleness_")
    model_dir = os.path.join(root, "model")
    make_model(model_dir)
    runs = []
    for seed in a.seeds:
        for eta in a.etas:
            for loss in ("decoupled", "naive"):
                runs.append(run_one(a, model_dir, root, loss, eta, seed))
                print(json.dumps({"run": runs[-1]}), file=sys.stderr)
    summary = {}
    for loss in ("decoupled", "naive"):
        for eta in a.etas:
            rs = [r for r in runs if r["loss"] == loss and r["eta"] == eta]
            s = {}
            for k in ("policy_reward", "train_reward", "trainer_tok_per_s", "wall_s", "gap_mean", "staleness_mean"):
                vals = [r[k] for r in rs]
                s[k], s[k + "_sd"] = statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)
            s["dropped_stale"] = sum(r["dropped_stale"] for r in rs)
            s["steps_to_0.9"] = [r["steps_to_0.9"] for r in rs]  # per seed; None = never reached
            summary[f"{loss}_eta{eta}"] = s
    png = plot(summary, a.etas, a.png or os.path.join(root, "staleness.png"))
    print(json.dumps({"bench": "staleness", "task": f"toy: fraction of tokens < {LOW} of {VOCAB}",
                      "steps": a.steps, "prompts": a.prompts, "n": a.n, "max_new_tokens": a.max_new, "lr": a.lr,
                      "seeds": a.seeds, "etas": a.etas, "summary": summary, "runs": runs, "plot": png, "root": root}))


if __name__ == "__main__":
    main()
