"""Builds notebooks/loss_ablation_replay.ipynb from the cell sources below (the notebook is
generated: edit THIS file, then rebuild, so the notebook stays reviewable as code).

    python notebooks/build_loss_ablation_replay.py            # rewrites notebooks/loss_ablation_replay.ipynb
    python notebooks/build_loss_ablation_replay.py --out X    # writes elsewhere

tests/test_loss_ablation_notebook.py rebuilds it and checks the committed .ipynb matches, then
executes its code cells on CPU. Output is deterministic (fixed cell ids, sorted keys, no outputs).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nb_build beside this file, however it is run

from nb_build import Notebook  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parent / "loss_ablation_replay.ipynb"
NB = Notebook(NOTEBOOK)
md, code = NB.md, NB.code


# ------------------------------------------------------------------------------------ cells
md("""
# A fair loss ablation: record one asynchronous run, replay it under several losses

Two training runs with different losses differ in more than the loss: each samples its own
trajectories, and in asynchronous mode the schedule (which weights sampled what, how stale each
batch was) differs too. Here we record the stream of batches one run's trainer consumed
(`--train.record=true`) and train every loss on **exactly those batches**, from the same
initial weights, with no generators (`common.replay.replay`).

- Replayed with the recording's own algorithm and config, the weights follow the recorded run's
  exactly (checked below): an asynchronous run becomes reproducible.
- Replayed with another loss, it is a fair comparison on identical data, but **off-policy**: the
  data were sampled by the recorded run's policy, not by the policy being trained. The stream keeps
  each token's behaviour log-prob (`batch.behav_logp`) and policy version (`batch.versions`) for
  losses that correct for it (as AReaL's decoupled PPO does).

The task is a toy that runs on a CPU in seconds: a tiny random model, and a reward equal to the
fraction of generated tokens with an id below 20 (`notebooks/toy_task.py`).

**Parameters** (the next cell is tagged `parameters`, so papermill or a test can override it).
Relative paths are relative to this notebook's folder (`notebooks/`).
""")

code("""
RUN_ROOT = "../runs/loss_ablation_replay"   # this notebook's own folder of runs (emptied first when FRESH)
FRESH = True                                # delete RUN_ROOT's earlier runs before recording
STEPS = 40                                  # trainer steps recorded (and replayed)
EVAL_EVERY = 10                             # steps between evaluations (also before and after)
""", tags=["parameters"])

code("""
import shutil
import sys
from pathlib import Path

import torch

ROOT = next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common" / "replay.py").is_file()), None)
if ROOT is None:
    raise RuntimeError(f"cannot find the repository root (a folder with common/replay.py) above {Path.cwd()}: "
                       "start Jupyter inside the repository")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.engine.machine.precision import PrecisionConfig
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.contracts.log import read_metrics
from common.contracts.ops import group_mean
from common.replay import plot_replays, replay
from common.runtime.generator import GenConfig
from common.runtime.files.stream import read_meta, read_steps
from common.runtime.train_config import TrainConfig
from common.task import RunConfig, run, setup
from notebooks.toy_task import prompts, tiny_model, toy_reward
from tba.algo import TBAConfig
from tba.loss import tb_loss_no_ref

root = Path(RUN_ROOT) if Path(RUN_ROOT).is_absolute() else (ROOT / "notebooks" / RUN_ROOT).resolve()
if FRESH:
    shutil.rmtree(root, ignore_errors=True)
root.mkdir(parents=True, exist_ok=True)
PROMPTS = prompts(16)
""")

md("""
## 1. Record an asynchronous TBA run

An ordinary run with `train.record=True`: one generator process samples into the replay buffer
while the trainer learns from it; every batch the trainer consumes goes to
`runs/<name>/stream/` (one safetensors file per step, readable while the run goes on).

`evaluate(model, tokenizer)` runs in this process (the trainer's), before, every `EVAL_EVERY`
steps and after: the mean reward of fresh samples from the policy, which is what a loss is for.
""")

code("""
def evaluate(model, tokenizer):
    '''Mean toy reward of 16 prompts x 4 fresh samples (fixed seed) from the policy.'''
    outs = Sampler(model, max_batch=64, max_seq_len=32).generate(
        PROMPTS.tokens, SamplingParams(max_new_tokens=6, temperature=1.0, n=4, seed=1))
    return {"eval_reward": sum(toy_reward(c.tokens, None) for c in outs) / len(outs)}


cfg = RunConfig(name="recorded", run_root=str(root), model=tiny_model(root / "tiny_model"), seed=0,
                gen=GenConfig(max_batch=16, max_new_tokens=6, n=4, temperature=1.0),
                train=TrainConfig(steps=STEPS, lr=3e-3, warmup_steps=1, prompts_per_step=4, sync_every=2,
                                  min_buffer=16, buffer_capacity=512, micro_batch_tokens=256,
                                  eval_every=EVAL_EVERY, record=True),
                tba=TBAConfig(beta_init=0.1, beta_final=0.1, m=0.5),
                precision=PrecisionConfig(dtype="fp32"))  # fp32: the same numbers on every CPU
setup(cfg)
recorded = run(cfg, PROMPTS, toy_reward, stop_token_ids=(), evaluate=evaluate)

stream = root / "recorded" / "stream"
steps = list(read_steps(stream))
print(f"stream: {len(steps)} steps, {sum(s.nbytes for s in steps) / len(steps) / 1e3:.1f} kB per step")
s = steps[-1]
print(f"step {s.step}: {len(s.batch)} rows trained by version {s.version}, token versions "
      f"{sorted(set(s.batch.versions[s.batch.loss_mask].tolist()))}, lr {s.lr:g}, "
      f"finish reasons {sorted(set(s.finish_reasons))}, recorded loss {s.stats['loss']:.4f}")
""")

md("""
## 2. Replay it under several losses

`replay(stream, algo, loss=..., name=...)` takes the algorithm as a name (`"tba"`, `"grpo"`,
`"areal"`; none: the recording's) and, as `loss`, a loss function for it, the same argument a
task's `main(argv, loss=...)` takes (README, "In a notebook"): for TBA any pure function with
`tb_loss`'s signature `(seq_logp, ref_seq_logp, reward, group_id, beta) -> loss or (loss, stats)`.
The one defined in the next cell lives only in this notebook: that works because a replay with
one trainer rank runs the loss in this process (`--train.trainer_devices` > 1 would have to send
it to other processes).

- **tb (as recorded)**: the recording's algorithm and config; must end on the recorded weights.
- **tb, no reference**: trajectory balance towards exp(r / beta), without pi_ref.
- **grpo**: the repository's PPO-clip baseline with group-normalised advantages (its importance
  ratio is against the recorded behaviour log-probs).
- **reinforce, group baseline (this notebook)**: -(r - mean_group r) * log pi(y), a mean over rows.
""")

code("""
def reinforce_group_baseline(seq_logp, ref_seq_logp, reward, group_id, beta):
    '''REINFORCE with the group-mean reward as baseline (ignores the reference and beta).'''
    adv = reward - group_mean(reward, group_id)
    return -(adv * seq_logp).mean(), {"adv_abs": adv.abs().mean().item()}


# label -> what `replay` is given besides the stream: an algorithm's name and / or a loss for it
# (no algorithm named: the recording's, TBA here)
variants = {
    "tb (as recorded)": {},
    "tb, no reference": {"loss": tb_loss_no_ref},
    "grpo": {"algo": "grpo"},
    "reinforce, group baseline": {"loss": reinforce_group_baseline},
}
runs = {}
for i, (label, how) in enumerate(variants.items()):
    name = f"replay{i}"
    replay(stream, name=name, evaluate=evaluate, **how)
    runs[label] = root / name
""")

md("""
## 3. Check and compare

The replay under the recording's own algorithm ends on the recorded run's final weights. Then
every variant side by side against the step: the loss each one optimised, its gradient norm, and
the reward of fresh samples from its policy (the recorded run's reward is the same data for all).
""")

code("""
from common.engine.checkpoints.hf_io import load_model
from common.runtime.files.checkpoint import latest_checkpoint

def final_weights(run_dir):
    return load_model(str(latest_checkpoint(run_dir) / "model"), tokenizer=False)[0].state_dict()

a, b = final_weights(root / "recorded"), final_weights(runs["tb (as recorded)"])
max_diff = max((a[k] - b[k]).abs().max().item() for k in a)
print(f"replay with the recorded algorithm vs the recorded run: max |weight difference| = {max_diff:.2e}")
assert max_diff <= 1e-6

summary = {}
for label, d in {"recorded run": root / "recorded", **runs}.items():
    rows = read_metrics(d / "metrics.jsonl")
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    summary[label] = {"eval_reward before": evals[0], "after": evals[-1], "final loss": losses[-1]}
    print(f"{label:<28} eval reward {evals[0]:.3f} -> {evals[-1]:.3f}   final loss {losses[-1]:+.4f}")
""")

code("""
fig = plot_replays([(root / "recorded", "recorded run (tb)"), *[(d, label) for label, d in runs.items()]],
                   root / "replays_side_by_side.png", title="one recorded stream, four losses")
fig  # the last expression of a cell: Jupyter shows the figure as an image
""")

md("""
## 4. On your own run

- Record any task: `python run_gsm8k.py --train.record=true --name=x` (any algorithm).
- Replay from the command line: `python -m common.replay runs/x/stream --name=x_grpo --algo=grpo`,
  with `--tba.*` / `--train.lr=...` overrides; `runs/x/replays.png` then lays the recorded run and
  its replays side by side. From Python: `replay("runs/x", loss=my_loss, name="x_mine")`.
- The stream's size per step is printed at the end of the run and logged as `record_bytes`.
- Read the caveat again before drawing conclusions: beyond step 1 every variant except the
  recorded one learns from data another policy sampled.
""")


write = NB.write  # the tests rebuild the notebook with it

if __name__ == "__main__":
    NB.main(__doc__)
