"""Helpers of `bench/gpu.py`: the SmolLM2-shaped default model's config, the seeded workload, timing,
the machine description and the async section's toy reward.

No slow import at module level: the async section's spawned generator imports this module for
`toy_reward` (a reward must be a module-level function: spawn pickles it by name).
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.autograd import DeviceType

# SmolLM2-135M-Instruct's exact shapes (its config.json); the weights are random
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)
# --smoke: the same architecture, tiny (CPU seconds)
TINY = dict(SMOLLM2_135M, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # prompts use ids >= 3 only
FIRST_ID = 3


@dataclass
class Ctx:
    """What every section needs: parsed args, device, resolved precision, checkpoint, workload."""
    args: object
    device: torch.device
    prec: object                      # common.engine.machine.precision.Precision
    ckpt: str                         # random checkpoint directory (config.json + safetensors)
    shape: dict                       # the LlamaConfig fields it was built with
    prompts: list[list[int]]          # the sampler workload's prompts (token ids)
    workdir: Path
    # called by a section with what it has measured so far: bench/gpu.py logs it and rewrites --out,
    # so a section stopped at its time limit keeps its finished parts
    progress: Callable[[str, dict], None] = field(default=lambda part, done: None)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def default_config(smoke: bool = False) -> dict:
    """The config.json dict of the default workload's model: SmolLM2-135M's shape, or TINY with --smoke."""
    from transformers import LlamaConfig  # lazy: slow import, only the main process builds
    cfg = LlamaConfig(**(TINY if smoke else SMOLLM2_135M), **SPECIAL_IDS)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg.to_dict()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of uniform random lengths in [lo, hi] and uniform random ids in [FIRST_ID, vocab)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(FIRST_ID, vocab, (L,), generator=g).tolist() for L in lens]


def sync(device) -> None:
    """Wait for the device's queued work (host timers around GPU work need it)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(prof, cuda: bool) -> tuple[float, int]:
    """(busy ms, events) of a finished profile: the union of the CUDA kernel/memcpy/memset
    intervals, or on the CPU the summed self time of the aten ops."""
    ev = prof.events()
    if not cuda:
        ops = [e for e in ev if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        return sum(e.self_cpu_time_total for e in ops) / 1e3, len(ops)
    # kernels, memcpy, memset; not user-annotation spans (they cover the gaps between kernels)
    spans = sorted((e.time_range.start, e.time_range.end) for e in ev
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # union: overlapping kernels (several streams) count once
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / 1e3, len(spans)


def kernel_counts(prof, steps: int, layers: int) -> dict:
    """Kernel launches per step of a finished profile (memcpy / memset left out), split into the
    per-layer ones (names launched at least once per layer per step) and the rest (the step's own:
    embedding, plan, head, sampling)."""
    per: dict[str, int] = {}
    for e in prof.events():
        if (e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                and not e.name.lower().startswith(("memcpy", "memset"))):
            per[e.name] = per.get(e.name, 0) + 1
    total = sum(per.values()) / steps
    layered = sum(n for n in per.values() if n / steps >= layers) / steps
    return {"kernels_per_step": total, "kernels_per_layer": layered / layers, "other_kernels_per_step": total - layered}


def top_kernels(prof, k: int = 10, steps: int = 1) -> dict:
    """The k CUDA kernels (by name, cut to 80 characters) taking the most device time in a finished
    profile: {name: [ms per step, launches per step]}."""
    per: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            v = per.setdefault(e.name[:80], [0.0, 0])
            v[0] += e.time_range.elapsed_us() / 1e3
            v[1] += 1
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:k]
    return {name: [round(ms / steps, 3), round(n / steps, 1)] for name, (ms, n) in top}


def free_memory(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def median(xs) -> float:
    return float(statistics.median(xs))


def toy_reward(tokens, meta) -> float:
    """The async section's reward: fraction of generated ids below `meta` (a tokenizer-free toy
    task as in tests/test_e2e.py; its value is irrelevant to the timing)."""
    return sum(t < meta for t in tokens) / max(1, len(tokens))


def machine(device: torch.device) -> dict:
    """GPU name, library versions, date and the command line, for the JSON record."""
    import transformers  # lazy: slow import (already loaded by the time this runs)
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv), "cwd": os.getcwd(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
            "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_mem_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                    gpu_count=torch.cuda.device_count())
    return info


def write_json(path, obj) -> None:
    """Atomic write (temp + rename), so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
