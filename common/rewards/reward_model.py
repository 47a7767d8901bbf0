"""Sequence-classification reward models: load any Hugging Face RM by path, score batches, and
train one with the Bradley-Terry loss.

Runs in reward-worker processes (`common/runtime/reward_service.py`: scoring during training), in the
trainer (a "gold" RM scoring evaluation summaries) and in a task's RM-training command
(`python run_tldr.py train-rm`).

Any `AutoModelForSequenceClassification` checkpoint with a scalar head (num_labels = 1) works:
the papers' Pythia RMs (decoder: "<prompt> <response>" is one text, scored at its last token,
truncated from the left so the response survives) or an encoder cross-encoder such as
the offline default built on MiniLM (prompt and response as a sentence pair; the longer of
the two, in practice the post, is truncated first). `input="auto"` picks pair encoding when the tokenizer has a separator token.

Bradley-Terry (the RM objective of the RLHF papers): P(chosen > rejected) = sigmoid(r_c - r_r),
    loss = -mean log sigmoid(r_c - r_r).
"""
from __future__ import annotations

import random
import re
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """-mean log sigmoid(r_chosen - r_rejected); both (B,)."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


class RewardModel:
    """A scalar-head sequence-classification model and its tokenizer, scoring (prompt, response)."""

    def __init__(self, path: str, device: str = "cpu", max_tokens: int = 512, batch_size: int = 16,
                 input: Literal["auto", "pair", "text"] = "auto", model=None, tokenizer=None,
                 dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # lazy: slow import
        self.path, self.device, self.max_tokens, self.batch_size = str(path), device, max_tokens, batch_size
        self.tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(self.path)
        self.model = (model if model is not None else
                      AutoModelForSequenceClassification.from_pretrained(self.path, dtype=dtype)).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {self.path}: a scalar head is needed (num_labels = 1), this one has "
                             f"num_labels = {self.model.config.num_labels}")
        if self.tok.pad_token is None:  # decoder RMs (Pythia, Llama) often have none: score at the last real token
            self.tok.pad_token = self.tok.eos_token
        self.model.config.pad_token_id = self.tok.pad_token_id
        self.pair = input == "pair" or (input == "auto" and self.tok.sep_token is not None)
        if not self.pair:
            self.tok.truncation_side = "left"  # keep the response (scored at the end)

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> dict[str, torch.Tensor]:
        if self.pair:
            enc = self.tok(list(prompts), list(responses), truncation="longest_first", max_length=self.max_tokens,
                           padding=True, return_tensors="pt")
        else:
            enc = self.tok([f"{p} {r}" for p, r in zip(prompts, responses)], truncation=True, max_length=self.max_tokens,
                           padding=True, return_tensors="pt")
        return {k: v.to(self.device) for k, v in enc.items()}

    def forward(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """(B,) rewards, with grad when the model is in training mode."""
        return self.model(**self.encode(prompts, responses)).logits[:, 0].float()

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """Rewards of (prompt, response) pairs, `batch_size` at a time."""
        self.model.eval()
        out: list[float] = []
        for i in range(0, len(prompts), self.batch_size):
            out += self.forward(prompts[i:i + self.batch_size], responses[i:i + self.batch_size]).tolist()
        return out

    def save(self, path) -> None:
        """An ordinary Hugging Face sequence-classification directory (model + tokenizer)."""
        self.model.save_pretrained(path)
        self.tok.save_pretrained(path)


def freeze_lower_layers(model, n: int) -> int:
    """Freeze the embeddings and the first n transformer layers (names `*embeddings*`,
    `*layer.<i>.*` / `*layers.<i>.*`): backward then stops early, which is most of the cost
    of fine-tuning on a CPU. Returns the number of trainable parameters left."""
    for name, p in model.named_parameters():
        m = re.search(r"\blayers?\.(\d+)\.", name)
        if "embeddings" in name or (m and int(m.group(1)) < n):
            p.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def pair_accuracy(rm: RewardModel, pairs: Sequence[tuple[str, str, str]]) -> float:
    """Fraction of (prompt, chosen, rejected) pairs with r(chosen) > r(rejected)."""
    if not pairs:
        raise ValueError("pair_accuracy: no pairs")
    rc = rm.score([p for p, _, _ in pairs], [c for _, c, _ in pairs])
    rr = rm.score([p for p, _, _ in pairs], [r for _, _, r in pairs])
    return sum(a > b for a, b in zip(rc, rr)) / len(pairs)


def train_bradley_terry(rm: RewardModel, pairs: Sequence[tuple[str, str, str]], epochs: int = 1, lr: float = 5e-5,
                        batch_size: int = 16, seed: int = 0, freeze_layers: int = 0, progress: bool = True) -> dict:
    """Fine-tune `rm` on (prompt, chosen, rejected) pairs with the Bradley-Terry loss (AdamW,
    linear decay); returns {'bt_loss_first', 'bt_loss_last', 'train_pair_acc_last', 'steps'}."""
    torch.manual_seed(seed)
    freeze_lower_layers(rm.model, freeze_layers)
    params = [p for p in rm.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order = list(range(len(pairs)))
    n_steps = epochs * ((len(pairs) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(1, n_steps))
    rm.model.train()
    losses, accs = [], []
    bar = tqdm(total=n_steps, desc="reward model (Bradley-Terry)", disable=not progress)
    for ep in range(epochs):
        random.Random(seed * 1000 + ep).shuffle(order)
        for i in range(0, len(order), batch_size):
            b = [pairs[j] for j in order[i:i + batch_size]]
            prompts = [p for p, _, _ in b]
            r = rm.forward(prompts + prompts, [c for _, c, _ in b] + [x for _, _, x in b])  # one pass: (2B,)
            rc, rr = r[:len(b)], r[len(b):]
            loss = bradley_terry_loss(rc, rr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            accs.append((rc > rr).float().mean().item())
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                            acc=f"{sum(accs[-20:]) / len(accs[-20:]):.2f}")
    bar.close()
    rm.model.eval()
    k = max(1, min(20, len(losses)))
    return {"bt_loss_first": sum(losses[:k]) / k, "bt_loss_last": sum(losses[-k:]) / k,
            "train_pair_acc_last": sum(accs[-k:]) / k, "steps": len(losses)}
