"""Evaluation helpers every task uses (trainer process, or a notebook).

- `greedy_pass_at_1`: a rule-graded task passes its tokenised prompts, per-prompt data for the
  reward and the reward function; a prompt counts as solved when the greedy completion scores
  >= threshold.
- `sample_completions` / `greedy_completions`, `completion_logps`: policy outputs on a fixed
  set, and their sequence log-probs under any model (the one log-prob function, `common.contracts.ops`),
  for KL to a reference.
- `win_vector`: per-prompt wins against a baseline under a judge's scores, ties counted 1/2.
- `bootstrap_diff`: the change of a per-prompt metric between two evaluations of the same
  prompts, with a paired 95% bootstrap interval.
"""
from __future__ import annotations

import numpy as np
import torch

from common.contracts.batch import Trajectory
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import Completion, SamplingParams
from common.contracts.ops import reference_seq_logp


@torch.no_grad()
def greedy_pass_at_1(model, tokenizer, prompts: list[list[int]], metas: list, reward_fn, max_new_tokens: int,
                     stop_token_ids: tuple, max_batch: int = 64, threshold: float = 1.0,
                     progress: bool | str = True) -> dict:
    """{'eval_accuracy', 'eval_len', 'eval_n'} over `prompts` (greedy decoding, one sample each)."""
    outs = greedy_completions(model, prompts, max_new_tokens, stop_token_ids, max_batch, progress)
    solved = 0
    for c, meta in zip(outs, metas):
        try:
            solved += float(reward_fn(tokenizer.decode(c.tokens, skip_special_tokens=True), meta)) >= threshold
        except Exception:  # noqa: BLE001 - an ungradable answer is a wrong answer
            pass
    return {"eval_accuracy": solved / len(prompts), "eval_len": sum(len(c.tokens) for c in outs) / len(outs),
            "eval_n": len(prompts)}


@torch.no_grad()
def sample_completions(model, prompts: list[list[int]], params: SamplingParams, max_batch: int = 64,
                       progress: bool | str = True) -> list[Completion]:
    """params.n completions per prompt from a sampler sized for this set, in prompt order. It is
    the generators' sampler: on CUDA its decode runs as CUDA graphs when the run decodes so
    (`--gen.cuda_graphs`, passed on as `model.decode_graphs`), instead of one launch per kernel.
    `progress`: a bar of the samples finished, labelled "eval" or with the string given (its ETA
    only once a rate is real: common/contracts/progress.py, `SampleBar`)."""
    P = max(len(p) for p in prompts)
    s = Sampler(model, max_batch=min(max_batch, len(prompts) * params.n), max_seq_len=P + params.max_new_tokens,
                max_prompt_len=P)
    return s.generate(prompts, params, progress="eval" if progress is True else progress)


def greedy_completions(model, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: tuple,
                       max_batch: int = 64, progress: bool | str = True) -> list[Completion]:
    """One greedy completion per prompt, in prompt order."""
    return sample_completions(model, prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                             stop_token_ids=tuple(stop_token_ids)), max_batch, progress)


@torch.no_grad()
def completion_logps(model, completions: list[Completion], temperature: float, batch: int = 16) -> list[float]:
    """Sum of token log-probs of each completion given its prompt under `model`, at `temperature`."""
    trajs = [Trajectory(torch.tensor(c.prompt_tokens), torch.tensor(c.tokens), c.logp_tensor(),
                        torch.zeros(len(c.tokens), dtype=torch.long), 0.0, 0, c.finish_reason) for c in completions]
    out: list[float] = []
    for i in range(0, len(trajs), batch):
        out += reference_seq_logp(model, trajs[i:i + batch], temperature).tolist()
    return out


def win_vector(scores: list[float], baseline: list[float], texts: list[str] | None = None,
               baseline_texts: list[str] | None = None, tie_tol: float = 1e-4) -> list[float]:
    """Per prompt: 1 if the judge scores the policy's text above the baseline's, 0 if below,
    1/2 on a tie. Tie rule (deterministic): identical texts (after stripping whitespace) are a
    tie without looking at the scores (a batched judge may differ in the last bits on the same
    input), and so are scores within `tie_tol`."""
    out = []
    for i, (a, b) in enumerate(zip(scores, baseline, strict=True)):
        same = texts is not None and baseline_texts is not None and texts[i].strip() == baseline_texts[i].strip()
        out.append(0.5 if same or abs(a - b) <= tie_tol else float(a > b))
    return out


def bootstrap_mean(values, n_boot: int = 10000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval of mean(values) (resampling seeded: deterministic)."""
    v = np.asarray(values, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, v.size, size=(n_boot, v.size))
    lo, hi = np.quantile(v[idx].mean(1), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def bootstrap_diff(before, after, n_boot: int = 10000, seed: int = 0, level: float = 0.95) -> dict:
    """mean(after) - mean(before) over the same prompts, with a paired bootstrap interval."""
    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"bootstrap_diff: need two equal-length non-empty vectors, got {a.shape} and {b.shape}")
    lo, hi = bootstrap_mean(b - a, n_boot, seed, level)  # paired: each prompt's difference resampled
    return {"before": float(a.mean()), "after": float(b.mean()), "diff": float(b.mean() - a.mean()),
            "ci_low": float(lo), "ci_high": float(hi), "n": int(a.size), "level": level}
