"""Builds notebooks/tb_loss_ablation.ipynb from the cell sources below (the notebook is
generated: edit THIS file, then rebuild, so the notebook stays reviewable as code).

    python notebooks/build_tb_loss_ablation.py            # rewrites notebooks/tb_loss_ablation.ipynb
    python notebooks/build_tb_loss_ablation.py --out X    # writes elsewhere

tests/test_notebook.py rebuilds it and checks the committed .ipynb matches, then executes it
on a tiny run directory. Output is deterministic (fixed cell ids, sorted keys, no outputs).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nb_build beside this file, however it is run

from nb_build import Notebook  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parent / "tb_loss_ablation.ipynb"
NB = Notebook(NOTEBOOK)
md, code = NB.md, NB.code


# ------------------------------------------------------------------------------------ cells
md("""
# Trajectory-balance loss ablation on a saved replay buffer

Question: on the *same* responses, how do TB loss variants differ in what they ask of the
policy? For each variant we measure the loss, the gradient norm w.r.t. the model parameters,
the per-response weight it puts on each response (`-d loss / d seq_logp`, the "advantage") and
how aligned the gradient directions of the variants are.

Nothing is trained here: we load the latest checkpoint of a run (policy + replay buffer),
compute the policy's sequence log-probs once, and differentiate every variant through that one
shared graph.

**Which run.** `RUN_DIR` is a GSM8K run of your own: `python run_gsm8k.py` (from the repository
root; README, Quick start) writes `runs/gsm8k_tba`. On a fresh clone there is none yet: then the
notebook makes a short run of the tiny random model (`--model=tiny`, under a minute on a CPU)
and analyses that, which shows every step of the analysis but nothing about learning (its
rewards are all 0).

**Parameters** (the next cell is tagged `parameters`, so papermill or a test can override it).
Relative paths are relative to this notebook's folder (`notebooks/`).
""")

code("""
RUN_DIR = "../runs/gsm8k_tba"    # a run directory written by run_gsm8k.py
MAKE_TINY_RUN = True             # RUN_DIR has no checkpoint: analyse a short run of the tiny model instead
TINY_RUN_DIR = "../runs/gsm8k_tiny_notebook"  # where that run goes (made once, reused after)
TEMPERATURE = 0.7                # log-probs at the sampling temperature (gen.temperature)
N_GROUPS = 2                     # prompt groups to analyse; the autograd graph of K ~300-token responses
                                 # costs ~3 GB per group on CPU (8 groups x 4 ran out of 24 GB)
BETAS = [0.004, 0.012, 0.05]     # one "tb" variant per beta
SEED = 0                         # which groups are picked
DEVICE = "cpu"                   # or "cuda"
""", tags=["parameters"])

md("""
## 1. Load the latest checkpoint: replay buffer and policy

The repository root is found by walking up from the working directory, so the notebook runs
from `notebooks/` (Jupyter's default) or from the repository root. The policy is loaded as this
machine's runs use it (`machine_precision()`: the GEMM backend, attention kernel and dtype a run
here picks, measured once per machine), so its passes cost what a trainer step's do.
""")

code("""
import functools
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import matplotlib.pyplot as plt

ROOT = next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "tba" / "loss.py").is_file()), None)
if ROOT is None:
    raise RuntimeError("cannot find the repository root (a folder with tba/loss.py) above "
                       f"{Path.cwd()}: start Jupyter inside the repository")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import run_gsm8k
from common.engine.machine.precision import machine_precision
from common.contracts.ops import group_mean, seq_logp, token_logp
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.files.checkpoint import latest_checkpoint
from tba.loss import linear_beta, tb_loss, tb_loss_no_ref


def here(path):
    '''A path of this notebook's parameters: relative ones are relative to notebooks/, whatever the cwd.'''
    p = Path(path).expanduser()
    return (p if p.is_absolute() else ROOT / "notebooks" / p).resolve()


run_dir = here(RUN_DIR)
ckpt = latest_checkpoint(run_dir)
if ckpt is None and MAKE_TINY_RUN:
    print(f"no checkpoint under {run_dir}: `python run_gsm8k.py` makes a real run there; "
          f"analysing a short run of the tiny model instead")
    run_dir = here(TINY_RUN_DIR)
    if latest_checkpoint(run_dir) is None:  # made once: 4 steps of the tiny random model, no evaluation
        run_gsm8k.main(["--model=tiny", f"--run_root={run_dir.parent}", f"--name={run_dir.name}",
                        "--train.steps=4", "--data.eval_size=0", "--overwrite"])
    ckpt = latest_checkpoint(run_dir)
if ckpt is None:
    raise FileNotFoundError(
        f"no checkpoint under {run_dir}/checkpoints (RUN_DIR={RUN_DIR!r}). Train a run first: "
        "run `python run_gsm8k.py` (it checkpoints every train.checkpoint_every steps), "
        "point RUN_DIR at an existing run directory, or set MAKE_TINY_RUN = True.")
if not (ckpt / "buffer.pt").is_file():
    raise FileNotFoundError(f"{ckpt} has no buffer.pt: this checkpoint was saved without its replay buffer")

meta_json = json.loads((ckpt / "meta.json").read_text())
buf = ReplayBuffer.load(ckpt / "buffer.pt")
prec = machine_precision(DEVICE)  # what a run on this machine picks, applied here (README, "In a notebook")
model, _ = prec.load(str(ckpt / "model"), device=DEVICE, role="trainer", tokenizer=False)
model.requires_grad_(True)
params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once

print(f"checkpoint  {ckpt}  (step {meta_json['step']}, version {meta_json.get('version')})")
print(f"policy      {sum(p.numel() for p in params) / 1e6:.2f}M parameters on {DEVICE}")
print(f"precision   {prec.summary()}")
for k, v in buf.stats().items():
    print(f"buffer      {k:<13} {v}")

# The run's own settings, when it saved them: warn if our TEMPERATURE differs from sampling's.
run_cfg = json.loads((ckpt / "config.json").read_text()) if (ckpt / "config.json").is_file() else {}
if "gen" in run_cfg and not math.isclose(run_cfg["gen"].get("temperature", TEMPERATURE), TEMPERATURE):
    print(f"WARNING: the run sampled at temperature {run_cfg['gen']['temperature']}, TEMPERATURE={TEMPERATURE}")
if "tba" in run_cfg:
    t = run_cfg["tba"]
    print(f"training beta at step {meta_json['step']}: "
          f"{linear_beta(meta_json['step'], t['beta_init'], t['beta_final'], t['beta_anneal_steps']):.4g}")
""")

md("""
## 2. Pick prompt groups

TB's log Z is estimated per prompt from its responses, so a group needs at least two distinct
responses to carry any signal. Like the training sampler, we keep one row per distinct
completion (the newest copy), using the buffer's completion hashes.
""")

code("""
m = buf.snapshot_meta()
newest_first = np.argsort(-m.insert_idx, kind="stable")
groups: dict[int, list[int]] = {}          # group_id -> ring rows, one per distinct completion
seen = set()
for pos in newest_first:
    key = (int(m.group_id[pos]), int(m.comp_hash[pos]))
    if key not in seen:
        seen.add(key)
        groups.setdefault(key[0], []).append(int(m.rows[pos]))
eligible = sorted(g for g, rows in groups.items() if len(rows) >= 2)
if not eligible:
    raise ValueError(f"no prompt group in {ckpt / 'buffer.pt'} has >= 2 distinct responses")
if len(eligible) < N_GROUPS:
    print(f"only {len(eligible)} groups have >= 2 distinct responses (N_GROUPS={N_GROUPS}): using all")
rng = np.random.default_rng(SEED)
picked = sorted(rng.choice(eligible, size=min(N_GROUPS, len(eligible)), replace=False).tolist())
rows = [r for g in picked for r in sorted(groups[g])]
batch = buf.get(rows).to(DEVICE)

HAS_REF = not torch.isnan(batch.ref_seq_logp).any().item()
print(f"{len(picked)} groups of {len(eligible)} eligible, {len(batch)} responses, "
      f"{int(batch.comp_lens.sum())} completion tokens")
print(f"responses per group: {[len(groups[g]) for g in picked]}")
print(f"reward mean {batch.reward.mean():.3f}, distinct rewards "
      f"{sorted({round(x, 4) for x in batch.reward.tolist()})[:10]}")
if not HAS_REF:
    print("NOTE: no reference log-probs in this buffer (gen.ref_logp=false): "
          "variants that use the reference give a non-finite loss and are skipped")
""")

md("""
## 3. The policy's sequence log-probs, once

`seq_logp` is the SUM of completion-token log-probs at `TEMPERATURE` (as in training). Every
variant below is differentiated through this one graph (`retain_graph=True`).
""")

code("""
model.eval()
tok_lp = token_logp(model, batch.tokens, TEMPERATURE, batch.loss_mask)   # (B, T), target-aligned
slp = seq_logp(tok_lp, batch.loss_mask)                                 # (B,), carries the graph
print(f"seq_logp: mean {slp.mean():.2f}, min {slp.min():.2f}, max {slp.max():.2f}")
if HAS_REF:
    print(f"log pi - log pi_ref: mean {(slp - batch.ref_seq_logp).mean():.3f}")
""")

md("""
## 4. The variants

A variant is a pure function with `tb_loss`'s signature,
`(seq_logp, ref_seq_logp, reward, group_id, beta) -> (loss, stats)`, bound to its beta here.
The custom one below shows how to add one: length-normalised TB divides both sequence
log-probs by the completion length before the TB residual (so long responses no longer
dominate the KL term). It needs the lengths, which `tb_loss`'s signature does not carry, so
they are bound with `functools.partial` here (in training, a loss gets them by keyword: section 6).
""")

code("""
def tb_loss_length_normalised(seq_logp, ref_seq_logp, reward, group_id, beta, *, comp_lens):
    \"\"\"TB on per-token (length-normalised) log-probs: residual logZ + (logpi - logpi_ref)/|y| - r/beta.\"\"\"
    n = comp_lens.to(seq_logp.dtype).clamp(min=1)
    return tb_loss(seq_logp / n, ref_seq_logp / n, reward, group_id, beta)


BASE_BETA = BETAS[len(BETAS) // 2]
# name -> loss with beta (and any extra keyword) bound: called as fn(seq_logp, ref_seq_logp, reward, group_id)
variants = {f"tb (beta={b:g})": functools.partial(tb_loss, beta=b) for b in BETAS}
variants[f"tb, no reference (beta={BASE_BETA:g})"] = functools.partial(tb_loss_no_ref, beta=BASE_BETA)
variants[f"tb, length-normalised (beta={BASE_BETA:g})"] = functools.partial(
    tb_loss_length_normalised, beta=BASE_BETA, comp_lens=batch.comp_lens)
print("\\n".join(variants))
""")

md("""
## 5. Loss, gradient norm and per-response weights

For each variant: the loss; the norm of its gradient w.r.t. all model parameters; and the
weight `w_j = -d loss / d seq_logp_j` it puts on response j (gradient descent raises
log pi(y_j) in proportion to w_j, so it plays the role of an advantage). For plain TB,
`w_j = 2/(N beta) * [(r_j - mean_g r) - beta (KL_j - mean_g KL)]` (tba/loss.py), checked below.

Flattened gradients are kept for the cosine matrix (one fp32 copy of the parameters per
variant: ~0.5 GB each for a 135M model).
""")

code("""
results, flat_grads = {}, {}
for name, fn in variants.items():
    loss, stats = fn(slp, batch.ref_seq_logp, batch.reward, batch.group_id)
    if not torch.isfinite(loss):
        print(f"skipped {name!r}: loss is {loss.item()} (no reference log-probs?)")
        continue
    (d_slp,) = torch.autograd.grad(loss, slp, retain_graph=True)
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                      for g, p in zip(grads, params)]).cpu()
    flat_grads[name] = flat
    results[name] = {"loss": loss.item(), "grad_norm": flat.norm().item(),
                     "weights": (-d_slp).detach().float().cpu().numpy(), "stats": stats}

reward_np = batch.reward.float().cpu().numpy()


def corr(a, b):
    return float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")


header = f"{'variant':<40} {'loss':>10} {'grad norm':>10} {'mean |w|':>10} {'corr(w,r)':>10} {'resid std':>10}"
print(header)
print("-" * len(header))
for name, res in results.items():
    w = res["weights"]
    print(f"{name:<40} {res['loss']:>10.4g} {res['grad_norm']:>10.4g} {np.abs(w).mean():>10.4g} "
          f"{corr(w, reward_np):>10.3f} {res['stats'].get('tb_residual_std', float('nan')):>10.4g}")
""")

code("""
# Sanity check: plain TB's weights are the KL-regularised, group-centred reward (tba/loss.py).
if HAS_REF:
    kl = (slp - batch.ref_seq_logp).detach().float()
    r = batch.reward.float()
    for b in BETAS:
        adv = (r - group_mean(r, batch.group_id)) - b * (kl - group_mean(kl, batch.group_id))
        w = torch.from_numpy(results[f"tb (beta={b:g})"]["weights"]) * len(batch) * b / 2
        err = (w - adv.cpu()).abs().max().item()
        print(f"beta={b:g}: max |N beta/2 * w - adv| = {err:.2e}")
        assert err <= 1e-3 * (1 + adv.abs().max().item()), "TB weights do not match the closed form"
""")

md("""
Per-response weight vs reward, one panel per variant (colour = prompt group, small horizontal
jitter so equal rewards do not overlap). A good variant separates high- and low-reward
responses of the same prompt; the KL term spreads responses of equal reward.
""")

code("""
names = list(results)
ncol = min(3, len(names))
nrow = math.ceil(len(names) / ncol)
fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
span = float(np.ptp(reward_np)) or 1.0
jitter = np.random.default_rng(SEED).uniform(-0.03, 0.03, size=len(reward_np)) * span
_, group_idx = np.unique(batch.group_id.cpu().numpy(), return_inverse=True)
for ax, name in zip(axes.flat, names):
    ax.scatter(reward_np + jitter, results[name]["weights"], c=group_idx, cmap="tab10", s=18,
               vmin=0, vmax=max(9, group_idx.max()))
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("reward")
    ax.set_ylabel("w = -dL/d seq_logp")
for ax in list(axes.flat)[len(names):]:
    ax.set_visible(False)
fig.suptitle(f"{ckpt.parent.parent.name} @ step {meta_json['step']}: per-response weights", fontsize=10)
fig.tight_layout()
""")

md("""
Cosine similarity between the variants' gradient directions (w.r.t. the parameters). Close to
1: the variants would move the policy the same way, up to step size (which the optimizer's
normalisation partly absorbs); low or negative: a genuinely different update.
""")

code("""
def dot64(a, b, chunk=1 << 22):
    # dot product accumulated in float64: one fp32 GEMM over ~1e8 entries is off by ~2%
    return sum(float(a[k:k + chunk].double() @ b[k:k + chunk].double()) for k in range(0, a.numel(), chunk))

sq = {n: dot64(flat_grads[n], flat_grads[n]) for n in names}
cos = np.array([[dot64(flat_grads[a], flat_grads[b]) / max((sq[a] * sq[b]) ** 0.5, 1e-300) for b in names]
                for a in names])
for i, n in enumerate(names):
    print(f"[{i}] {n}")
print("     " + "".join(f"{f'[{j}]':>8}" for j in range(len(names))))
for i in range(len(names)):
    print(f"[{i}]  " + "".join(f"{cos[i, j]:>8.3f}" for j in range(len(names))))
""")

md("""
## 6. Adding your own variant and training with it

1. Write a pure function that takes `tb_loss`'s arguments,
   `my_loss(seq_logp, ref_seq_logp, reward, group_id, beta)`, and by keyword any micro-batch
   field it needs (`comp_lens`, `prompt_lens`, `tokens`, ...: the length-normalised variant
   above works as it is), returning the loss or `(loss, stats)` (stats: scalars, every one
   logged with the training metrics); add it to `variants` above and rerun.
2. To train with it, hand it to the task (defined here in the notebook is fine: it reaches the
   trainer's other ranks by value); the trainer calls it per micro-batch of whole groups, with
   the annealed beta:

   ```python
   import run_gsm8k
   run_gsm8k.main(["--name=gsm8k_lennorm", "--train.steps=40", "--overwrite"], loss=tb_loss_length_normalised)
   ```

   (`common.task.run(..., loss=...)` and `make_algo(cfg, loss)` take the same: a loss
   function, or a whole `Algorithm` object.) With a buffer that has no reference log-probs
   (`--gen.ref_logp=false`) only a variant that ignores `ref_seq_logp` works (e.g.
   `tb_loss_no_ref`).
""")


write = NB.write  # the tests rebuild the notebook with it

if __name__ == "__main__":
    NB.main(__doc__)
