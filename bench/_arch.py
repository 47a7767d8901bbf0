"""Random models of a published model's shape for the CPU benchmarks (`--arch`): the engine's speed
on another family, measured on the same work as the default model's figures, nothing downloaded.

The shapes are common/engine/checkpoints/shapes.py's (`ARCHS` names two of them by a short name); the model is
built once by `random_model_dir` into `$ASYNCRL_CACHE/random_models/`, with the default model's
tokenizer (SmolLM2's 49,152 ids fit both vocabularies), so prompts and lengths are the default
model's workload.
"""
from __future__ import annotations

import argparse

from common.engine.checkpoints.hf_io import DEFAULT_MODEL, has_tokenizer, load_tokenizer, resolve_checkpoint
from common.engine.checkpoints.shapes import random_model_dir

ARCHS = {"pythia-160m": "EleutherAI/pythia-160m", "gpt2-124m": "gpt2"}  # short name -> hub id of the shapes table


def add_arch_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--arch", choices=sorted(ARCHS), default=None,
                    help="instead of --model: a random model of this published shape, built locally (bench/_arch.py)")


def arch_dir(name: str) -> str:
    """The checkpoint directory of a random `name`-shaped model (built on first use)."""
    return str(random_model_dir(ARCHS[name]))


def prompt_tokenizer(model: str):
    """The model's tokenizer, or the default model's for a model without one."""
    path = resolve_checkpoint(model)
    return load_tokenizer(path if has_tokenizer(path) else resolve_checkpoint(DEFAULT_MODEL))
