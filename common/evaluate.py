"""Greedy pass@1 evaluation with the KV-cache sampler (trainer process, or a notebook).

A rule-graded task passes its tokenised prompts, per-prompt data for the reward and the
reward function; a prompt counts as solved when the greedy completion scores >= threshold.
"""
from __future__ import annotations

import torch

from common.sampler import Sampler
from common.sampling import SamplingParams


@torch.no_grad()
def greedy_pass_at_1(model, tokenizer, prompts: list[list[int]], metas: list, reward_fn, max_new_tokens: int,
                     stop_token_ids: tuple, max_batch: int = 64, threshold: float = 1.0,
                     progress: bool = True) -> dict:
    """{'eval_accuracy', 'eval_len', 'eval_n'} over `prompts` (greedy decoding, one sample each)."""
    P = max(len(p) for p in prompts)
    s = Sampler(model, max_batch=min(max_batch, len(prompts)), max_seq_len=P + max_new_tokens, max_prompt_len=P)
    outs = s.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                              stop_token_ids=tuple(stop_token_ids)), progress=progress)
    solved = 0
    for c, meta in zip(outs, metas):
        try:
            solved += float(reward_fn(tokenizer.decode(c.tokens, skip_special_tokens=True), meta)) >= threshold
        except Exception:  # noqa: BLE001 - an ungradable answer is a wrong answer
            pass
    return {"eval_accuracy": solved / len(prompts), "eval_len": sum(len(c.tokens) for c in outs) / len(outs),
            "eval_n": len(prompts)}
