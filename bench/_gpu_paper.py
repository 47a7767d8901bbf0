"""The papers' model sizes for `bench/gpu.py --arch`: a random checkpoint of a published shape
(common/engine/checkpoints/shapes.py's table, by hub id or a short alias), a tiny model of the same family for
`--smoke`, and the two figures that need the card's speeds.

floor  A decode step reads every weight it multiplies once (the input embedding is a gather of a
       few rows: left out where it is not tied to the head) and the live K/V once: each prompt's
       entries once (its n samples share them) and each row's own tokens. floor_ms = those bytes /
       the card's memory bandwidth; `decode_over_floor` = the step's GPU time / floor_ms. Beside it
       the compute floor, 2 x multiplied parameters x rows / the card's peak.
mfu    6 x parameters x tokens / step seconds / the card's peak dense bf16 FLOP/s (every parameter
       counted, attention's FLOPs and checkpointing's recompute not: the usual count);
       `mfu_matmul` counts only the multiplied parameters (the untied input embedding left out).
sampler  ours against transformers' static-cache compiled `generate` on the default workload (a
       system ratio: bench/_gpu_gen.py), beside the two tok/s.
At --arch a run takes the lease's settings where no flag says otherwise (`ARCH_DEFAULTS`: the
run's own sampler setting, transformers' compiled static cache alone, no ragged schedule, a
trainer step of 16 x 1024 tokens). The card's bandwidth and peak come from its name (`CARDS`, the
first match) or from `--mem-bw-tbs` / `--peak-tflops`; on a card not listed and without them the
ratios are None.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from common.engine.kv import budget as kv_budget
from common.engine.checkpoints.hf_io import build_dir
from common.engine.model.model_config import ModelConfig
from common.engine.checkpoints.shapes import SHAPES, hf_config

ALIASES = {"pythia-1b": "mnoukhov/pythia1b-sft-tldr",                  # TBA's TL;DR policy (GPT-NeoX)
           "rho-1b": "realtreetune/rho-1b-sft-GSM8K",                   # TBA's GSM8K policy (1.1B Llama)
           "r1-qwen-1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"}  # AReaL's policy (Qwen2)
# name substring -> (memory bandwidth bytes/s, peak dense bf16 FLOP/s), the vendors' figures
CARDS = (("H200", 4.8e12, 989e12), ("H100 PCIe", 2.0e12, 756e12), ("H100 NVL", 3.9e12, 835e12),
         ("H100", 3.35e12, 989e12), ("A100", 2.0e12, 312e12))
# what --arch changes when no flag says otherwise (not in --smoke): a 1B trainer step of 16 x 1024
# tokens fits one 80 GB card without checkpointing; the lease's settings only (the run's own)
ARCH_DEFAULTS = dict(train_rows=16, train_tokens=1024, train_prompt=256, ours="ours_overlap",
                     hf_settings="hf_static_compiled", sampler_parts="default", decode_schedule=False)
# --smoke: the family kept, the sizes cut (CPU seconds)
_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512, max_position_embeddings=1024)
_TINY_FAMILY = {"gpt_neox": dict(intermediate_size=256),
                "llama": dict(intermediate_size=128, num_key_value_heads=2, head_dim=16),
                "qwen2": dict(intermediate_size=128, num_key_value_heads=2)}


def hub_id(arch: str) -> str:
    """An alias or a hub id of common/engine/checkpoints/shapes.py's table -> the hub id (ValueError else)."""
    h = ALIASES.get(arch, arch)
    if h not in SHAPES or SHAPES[h][1] != "causal":
        raise ValueError(f"--arch {arch!r}: use one of {sorted(ALIASES)} or a causal hub id of common/engine/checkpoints/shapes.py")
    return h


def arch_config(arch: str, smoke: bool = False) -> dict:
    """The config.json dict of `arch`'s published shape; `smoke`: its family at tiny sizes."""
    h = hub_id(arch)
    if not smoke:
        return hf_config(h)
    import transformers  # lazy: slow import, only where a checkpoint is built
    model_type, _, kw = SHAPES[h]
    kw = {**kw, **_TINY, **_TINY_FAMILY.get(model_type, {})}
    kw.update({k: min(kw[k], 2) for k in ("bos_token_id", "eos_token_id") if k in kw})  # inside the tiny vocab
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cfg.architectures = hf_config(h)["architectures"]
    return cfg.to_dict()


def build_arch(path: Path, cfg: dict, device: torch.device, seed: int = 0) -> dict:
    """A bf16 checkpoint of `cfg` with transformers' random init (seeded), drawn on `device` (a 1.5B
    model in seconds on a GPU), saved to `path` once: a `path` with a config.json is reused (the
    lease's sections of one shape share it). Returns parameters, bytes, the input embedding's size."""
    import transformers  # lazy: slow import, only the main process builds
    t = time.perf_counter()
    reused = (path / "config.json").exists()
    if not reused:
        for dev in dict.fromkeys([torch.device(device), torch.device("cpu")]):  # the CPU if the device fails
            try:
                torch.manual_seed(seed)
                with dev:
                    m = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                                      dtype=torch.bfloat16)
                break
            except Exception as e:  # noqa: BLE001 - a build on the device that fails is tried on the CPU
                if dev.type == "cpu":
                    raise
                print(f"[gpu] building on {dev} failed ({type(e).__name__}: {e}); on the CPU", file=sys.stderr)
        build_dir(path, lambda tmp: m.save_pretrained(str(tmp)))
        del m
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    cfg = json.loads((path / "config.json").read_text())
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    n = sum(p.numel() for p in m.parameters())  # tied weights once
    emb = m.get_input_embeddings().weight.numel()
    tied = m.get_input_embeddings().weight is m.get_output_embeddings().weight
    return {"path": str(path), "params": n, "param_bytes": 2 * n, "dtype": "bfloat16", "seed": seed,
            "embedding_params": emb, "tied_embeddings": tied, "matmul_params": n if tied else n - emb,
            "model_type": cfg["model_type"], "reused": reused, "build_s": round(time.perf_counter() - t, 2)}


def card(gpu_name: str | None, mem_bw_tbs: float | None = None, peak_tflops: float | None = None) -> dict:
    """The card's memory bandwidth (bytes/s) and peak dense bf16 FLOP/s: the flags, else its name."""
    bw, peak, src = None, None, "unknown card"
    for key, b, p in CARDS:
        if gpu_name and key in gpu_name:
            bw, peak, src = b, p, f"CARDS[{key!r}]"
            break
    if mem_bw_tbs:
        bw, src = mem_bw_tbs * 1e12, src + ", --mem-bw-tbs"
    if peak_tflops:
        peak, src = peak_tflops * 1e12, src + ", --peak-tflops"
    return {"gpu": gpu_name, "mem_bw_bytes_s": bw, "peak_flops": peak, "source": src}


def kv_bytes_per_token(cfg: dict, itemsize: int = 2) -> int:
    """K and V of one cached position over every layer, of a config.json dict (kv_budget's count)."""
    return kv_budget.kv_bytes_per_token(ModelConfig.from_hf(cfg), itemsize)


def decode_floor(weight_bytes: int, kv_bytes: int, mem_bw: float | None, flops: float = 0.0,
                 peak: float | None = None) -> dict:
    """The step's bandwidth floor (ms) from the bytes it must read, and its compute floor."""
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "floor_ms": 1e3 * (weight_bytes + kv_bytes) / mem_bw if mem_bw else None,
            "compute_floor_ms": 1e3 * flops / peak if peak else None}


def mfu(params: int, tokens_per_s: float, peak: float | None) -> float | None:
    """6 x params x tokens/s over the peak FLOP/s."""
    return 6.0 * params * tokens_per_s / peak if peak else None


def _entry(value, bar: float, above: bool, **kw) -> dict:
    met = None if value is None else (value >= bar if above else value <= bar)
    return {"value": value, "bar": bar, "need": f"{'>=' if above else '<='} {bar}", "met": met, **kw}


def paper_figures(res: dict, args) -> tuple[dict, dict]:
    """(the floor and MFU figures, their `targets` entries) from the sections that ran at --arch."""
    m, out, t = res["model"], {}, {}
    size = {k: 4 if "32" in str(res["precision"].get(k)) else 2 for k in ("dtype", "kv")}  # bytes: the run's weights, K/V
    c = card(res["machine"].get("gpu"), args.mem_bw_tbs, args.peak_tflops)
    out["card"] = c
    d = res.get("decode", {})
    v = next((d[k] for k in ("ours_overlap", "ours_cuda_graphs", "ours_eager") if d.get(k, {}).get("gpu_ms")), None)
    if v is not None and v.get("own_cols_profiled") is not None:
        kvt = kv_bytes_per_token(m["shape"], size["kv"])
        live = v["prompt_tokens_live"] + v["rows"] * v["own_cols_profiled"]
        f = decode_floor(size["dtype"] * m["matmul_params"], kvt * live, c["mem_bw_bytes_s"], 2.0 * m["matmul_params"] * v["rows"],
                         c["peak_flops"])
        f.update(rows=v["rows"], kv_bytes_per_token=kvt, kv_tokens_live=live, gpu_ms=v["gpu_ms"],
                 decode_over_floor=v["gpu_ms"] / f["floor_ms"] if f["floor_ms"] else None)
        out["decode"] = f
        t["decode_over_bandwidth_floor"] = _entry(f["decode_over_floor"], 2.0, False, rows=v["rows"],
                                                  gpu_ms=v["gpu_ms"], floor_ms=f["floor_ms"])
    tr = res.get("trainer", {})
    # rows with shared prompts run fewer tokens than tok_s counts: not an MFU
    runs = {k: x for k, x in tr.items() if isinstance(x, dict) and "tok_s" in x and not x.get("shared_prompts")}
    if runs:
        out["trainer"] = {k: {"tok_s": x["tok_s"], "step_s": x["step_s"], "mfu": mfu(m["params"], x["tok_s"], c["peak_flops"]),
                              "mfu_matmul": mfu(m["matmul_params"], x["tok_s"], c["peak_flops"])} for k, x in runs.items()}
        best = max(out["trainer"], key=lambda k: out["trainer"][k]["tok_s"])
        t["trainer_mfu"] = _entry(out["trainer"][best]["mfu"], 0.40, True, setting=best,
                                  tok_s=out["trainer"][best]["tok_s"])
    s = res.get("sampler", {})
    best = s.get("ours_best")
    if best:
        out["sampler"] = {"ours": best, "ours_tok_s": s[best]["tok_s"],
                          **{f"{h}_tok_s": s[h]["tok_s"] for h in ("hf_static", "hf_static_compiled") if "tok_s" in s.get(h, {})},
                          "ours_over_hf_static_compiled": s.get("ours_over_hf_static_compiled")}
    if "ours_over_hf_static_compiled" in s:
        t["sampler_over_hf_static_compiled"] = _entry(s["ours_over_hf_static_compiled"], 2.0, True, ours=s.get("ours_best"),
                                                      kind="system")
    return out, {f"{res['model']['arch']}_{k}": x for k, x in t.items()}
