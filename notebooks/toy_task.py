"""The toy task of notebooks/loss_ablation_replay.ipynb: a tiny random Llama (built locally,
never downloaded) and a reward on token ids, kept in a file so that the notebook shows only the
losses (a reward defined in a notebook cell works as well: it reaches the generators by value).

Reward of a completion: the fraction of its tokens with an id below LOW. A random model starts
near LOW / vocab ~ 0.2; a policy that learns the task moves towards 1.
"""
from __future__ import annotations

import torch

from common.contracts.batch import PromptSet
from common.engine.checkpoints.tiny_model import build_tiny

LOW = 20      # token ids below this earn reward
VOCAB = 97    # the tiny model's vocabulary (ids 0..96; no tokenizer: rewards see ids)


def toy_reward(tokens, meta) -> float:
    """tokens: the completion's ids (the tiny model has no tokenizer, so a reward sees ids)."""
    return sum(t < LOW for t in tokens) / max(1, len(tokens))


def tiny_model(path, seed: int = 0) -> str:
    """Write a random 2-layer model of the default architecture (hidden 32, no tokenizer) as a
    Hugging Face directory at `path` (`common/engine/checkpoints/tiny_model.py`); returns it."""
    return str(build_tiny(path, vocab_size=VOCAB, seed=seed, hidden_size=32, intermediate_size=64, head_dim=8))


def prompts(n: int = 16, seed: int = 0) -> PromptSet:
    """n random prompts of 2-5 tokens (ids 10..89)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 6, (n,), generator=g)
    return PromptSet([torch.randint(10, 90, (int(k),), generator=g).tolist() for k in lens])
