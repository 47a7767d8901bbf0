"""The TL;DR task's reward models (run_tldr.py): scoring with one (the task's reward, batched in
reward-worker processes, and the evaluation's gold RM), and the two offline ones it trains by
default (`python run_tldr.py train-rm`): MiniLM cross-encoders fine-tuned with the Bradley-Terry
loss (common/rewards/reward_model.py) on pairs built from the local sample, where the true TL;DR is
preferred over another post's TL;DR, the post's lead sentence, a truncated and a shuffled TL;DR.
The policy RM learns from the first half of the training posts, the "gold" RM (evaluation only,
as the papers judge with a larger RM) from the second half, with another seed. Training runs in
the launching process; a trained RM is cached as a Hugging Face directory with its report. The
run config's `reward` section (`RewardConfig`) is defined here, beside what reads it.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from common.contracts.config_check import at_least, between
from common.rewards.embed import minilm_dir
from common.engine.checkpoints.hf_io import cache_root
from common.contracts.errors import UserError
from common.rewards.reward_model import RewardModel, pair_accuracy, train_bradley_terry

RM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --reward.dtype


@dataclass
class RewardConfig:
    model: str = "offline"              # HF sequence-classification RM dir; "offline": the MiniLM RM built by train-rm (on first use)
    gold_model: str = "offline"         # RM that only judges evaluation; "offline": a second MiniLM RM (other posts, other seed)
    input: Literal["auto", "pair", "text"] = "auto"  # (post, summary) as a sentence pair, or one text; auto: pair if the tokenizer has [SEP]
    max_tokens: int = 128               # RM input tokens (the post is truncated first; 128 keeps the offline RM's training at minutes on a CPU)
    batch_size: int = 16                # RM batch when scoring
    device: str = "cpu"                 # where the reward models run (reward workers, evaluation's gold RM)
    dtype: Literal["fp32", "bf16"] = "fp32"  # the reward models' weights when scoring; bf16 halves their memory (scores move by bf16's rounding)

    CHECKS = {"max_tokens": at_least(1), "batch_size": at_least(1)}  # ranges (common/contracts/config_check.py)


@dataclass
class RMTrainConfig:
    pairs_per_post: int = 2             # rejected summaries per post, drawn from the four kinds (other post's, lead, truncated, shuffled)
    epochs: int = 1                     # passes over the pairs
    lr: float = 1e-4                    # AdamW, linear decay
    batch_size: int = 16                # pairs per step
    freeze_layers: int = 3              # embeddings + the first N of MiniLM's 6 layers frozen (halves the backward)
    eval_posts: int = 100               # held-out validation posts (x 4 pairs) for pair accuracy (never trained on)

    CHECKS = {"pairs_per_post": between(1, 4), "epochs": at_least(1), "lr": between(0, 1, open_lo=True),
              "batch_size": at_least(1), "freeze_layers": between(0, 6), "eval_posts": at_least(1)}  # ranges (common/contracts/config_check.py)


def make_rm_reward(path: str, input: str, max_tokens: int, batch_size: int, device: str = "cpu", dtype: str = "fp32"):
    """Reward-worker factory (common/runtime/reward_service.py): load the RM once (weights in `dtype`,
    "fp32" or "bf16"), then score a group fn(summaries, posts) in one batched call."""
    rm = RewardModel(path, device=device, max_tokens=max_tokens, batch_size=batch_size, input=input,
                     dtype=RM_DTYPES[dtype])
    return lambda texts, posts: rm.score(rm_prompts(rm, posts), [t.strip() for t in texts])


def rm_prompts(rm, posts: list[str]) -> list[str]:
    """What an RM sees before the summary: the post (a sentence pair for encoder RMs), or the
    papers' "<post>\nTL;DR:" when post and summary are one text (decoder RMs such as Pythia's)."""
    return list(posts) if rm.pair else [f"{p}\nTL;DR:" for p in posts]


def offline_rm_dir(which: str) -> Path:
    """Where the offline `which` ("policy" or "gold") reward model is cached."""
    return cache_root() / "tldr_rm" / which


def preference_pairs(examples: list, per_post: int, seed: int) -> list[tuple[str, str, str, str]]:
    """(post, chosen = the true TL;DR, rejected, kind) with `per_post` kinds drawn per post of:
    another post's TL;DR, the post's lead sentence, the TL;DR cut to its first half, shuffled."""
    rng = random.Random(seed)
    out = []
    for i, ex in enumerate(examples):
        post, words = " ".join(ex.sentences), ex.summary.split()
        for kind in rng.sample(["other", "lead", "truncated", "shuffled"], per_post):
            if kind == "other":
                rej = examples[(i + rng.randrange(1, len(examples))) % len(examples)].summary
            elif kind == "lead":
                rej = ex.sentences[0]
            elif kind == "truncated":
                rej = " ".join(words[:max(1, len(words) // 2)])
            else:
                rej = " ".join(rng.sample(words, len(words)))
            if rej.strip() != ex.summary.strip():
                out.append((post, ex.summary, rej, kind))
    return out


def train_offline_rms(train_ex: list, val_ex: list, rm_cfg: RMTrainConfig, max_tokens: int) -> dict:
    """Fine-tune the policy RM (first half of `train_ex`) and the gold RM (second half, another seed)
    from MiniLM (Bradley-Terry, inputs cut to `max_tokens`), report held-out pair accuracy on
    `val_ex`, save both as Hugging Face directories in the cache."""
    from transformers import AutoModelForSequenceClassification  # lazy: slow import, train-rm only
    base = minilm_dir()
    held_out = preference_pairs(val_ex, 4, seed=2)
    half, report = len(train_ex) // 2, {}
    for which, exs, seed in (("policy", train_ex[:half], 0), ("gold", train_ex[half:], 1)):
        t = time.perf_counter()
        pairs = preference_pairs(exs, rm_cfg.pairs_per_post, seed)
        rm = RewardModel(str(base), max_tokens=max_tokens, batch_size=32, input="pair",
                         model=AutoModelForSequenceClassification.from_pretrained(base, num_labels=1))
        stats = train_bradley_terry(rm, [p[:3] for p in pairs], rm_cfg.epochs, rm_cfg.lr, rm_cfg.batch_size, seed,
                                    rm_cfg.freeze_layers)
        by_kind = {k: pair_accuracy(rm, [p[:3] for p in held_out if p[3] == k])
                   for k in ("other", "lead", "truncated", "shuffled")}
        acc = sum(by_kind[p[3]] for p in held_out) / len(held_out)  # pair-weighted mean over kinds
        report[which] = {"posts": len(exs), "pairs": len(pairs), "seed": seed, **stats, "held_out_pairs": len(held_out),
                         "held_out_acc": acc, "held_out_acc_by_kind": by_kind,
                         "train_s": time.perf_counter() - t}
        out = offline_rm_dir(which)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        rm.save(tmp)
        (tmp / "rm_report.json").write_text(json.dumps(report[which], indent=2) + "\n")  # last: marks it complete
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        print(f"[tldr] {which} RM: held-out pair accuracy {acc:.3f} (by kind "
              + ", ".join(f"{k} {v:.2f}" for k, v in by_kind.items()) + f"), {report[which]['train_s']:.0f} s -> {out}")
    return report


def resolve_rm(value: str, which: str, train: Callable[[], dict]) -> str:
    """A reward model: a local directory or a hub id (owner/name, loaded by transformers) as given,
    or for "offline" the cached MiniLM RM (`train()` trains both now if it is missing)."""
    if value != "offline":
        hub_id = value.count("/") == 1 and not value.startswith((".", "/", "~")) and not Path(value).exists()
        if not (Path(value).is_dir() or hub_id):
            flag = "--reward.gold_model" if which == "gold" else "--reward.model"
            raise UserError(f"{flag}={value}: neither a local directory nor a hub id (a Hugging Face "
                            f"sequence-classification checkpoint); or 'offline' (python run_tldr.py train-rm)")
        return value
    d = offline_rm_dir(which)
    if not (d / "rm_report.json").is_file():
        print(f"[tldr] no offline {which} reward model in {d}: training both now (python run_tldr.py train-rm)")
        train()
    return str(d)
