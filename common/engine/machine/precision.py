"""Which precision and GEMM backend this machine should use, decided from the CPU, not a constant.

The trainer (main process) calls `resolve` once at start; the resolved `Precision` is printed,
saved with the run (`precision.json` and the metrics' config) and handed to the generator
processes, which apply it without measuring again. Five choices, each `auto` or forced:

  dtype   compute dtype. bf16 means mixed precision as on GPUs: the trainer keeps fp32 master
          weights and optimizer state and runs forward passes under bf16 autocast (log-softmax
          and losses stay fp32, `common/contracts/ops.py`); generators and the reference model hold bf16
          weights; the weight store publishes bf16 (the fp32 -> bf16 cast is the copy it
          already makes). auto on CPU: bf16 only if the CPU reports bf16 dot-product hardware
          (AMX-BF16 or AVX512-BF16) AND a measured bf16 GEMM beats the best fp32 GEMM by
          BF16_MIN_GAIN; otherwise fp32. auto on CUDA: bf16.
  gemm    backend of CPU fp32 GEMMs (`common/engine/model/linear.py`): oneDNN or ATen's F.linear (MKL or
          OpenBLAS); auto = the faster one on the trainer's GEMMs (which wins differs between
          CPUs: `common/engine/model/linear.py`). bf16 GEMMs already run on oneDNN.
  kv      dtype of the sampler's KV cache and attention. The CPU flash-attention kernel can be
          much slower in bf16 than in fp32 at decode shapes (one query row); auto on CPU = the
          faster one measured (only asked when dtype is bf16); on CUDA = dtype.
  attention  CPU fp32 causal attention of full passes (the trainer's, reference and evaluation
          passes): our kernel (`common/engine/model/causal_attention.py`) or PyTorch's CPU flash kernel
          (F.scaled_dot_product_attention); auto = the faster one measured. bf16, autocast and
          CUDA always take F.scaled_dot_product_attention.
  decode  the sampler's decode step: its layer body run eagerly or through torch.compile
          (`common/engine/sampler/decode_model.py`). auto on CUDA = compiled (a few fused kernels per layer
          instead of ~90). auto on CPU = what this machine measured in the run's dtype: compiled
          where it ran the decode step DECODE_MIN_GAIN faster than eager, else eager; eager where
          it was never measured. Measuring compiles the decode pieces (tens of seconds cold), too
          much for every first run on a machine, so it is taken on request, once per machine
          (`python -m common.runtime.measure_decode`), and `resolve` only reads it.
  decode_gemm  the sampler's decode GEMMs in bf16 on CPU: F.linear (`plain`), or oneDNN on weights
          packed once into its blocked layout (`packed`: `common/engine/model/linear.py`, a private copy
          of the decode weights per sampler); auto = packed where the machine measured the decode
          step's GEMMs DECODE_GEMM_MIN_GAIN faster so, else plain; fp32 decode and CUDA: plain.

The measurements behind `auto` (and their per-machine cache) are `common/engine/machine/cpu.py`'s.
Outside a run (a notebook or a script calling `load_model` and `token_logp`) the process keeps its
import-time kernels (oneDNN GEMMs, our attention kernel, fp32) until `machine_precision()` applies
what a run on this machine would pick: one line, `prec = machine_precision()`, then
`prec.load(path, role="trainer")` for the run's dtype too.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from common.engine.model.causal_attention import set_kernel
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.linear import bf16_packing_available, set_onednn
from common.engine.machine.cpu import cached_decode, cpu_info, has_bf16_hardware, measured, onednn_faster

BF16_MIN_GAIN = 1.5  # bf16 GEMM must beat fp32 by this much: GEMMs are ~50-70% of a step and
# autocast adds a weight cast per micro-batch, so a smaller GEMM gain would not pay for them
DECODE_MIN_GAIN = 1.05  # compiled decode must beat eager by this much: each generator pays the compile at start
DECODE_COMMAND = "python -m common.runtime.measure_decode"  # takes the decode measurement
DECODE_GEMM_MIN_GAIN = 1.1  # packed decode GEMMs must beat F.linear by this much: the copy costs memory
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class PrecisionConfig:
    dtype: Literal["auto", "fp32", "bf16"] = "auto"   # compute dtype; auto: bf16 only where the CPU is measured faster in it
    gemm: Literal["auto", "onednn", "aten"] = "auto"  # CPU fp32 GEMM backend; auto: the faster on the trainer's GEMMs, measured
    kv: Literal["auto", "fp32", "bf16"] = "auto"      # sampler KV cache / attention dtype; auto: measured (CPU), = dtype (CUDA)
    attention: Literal["auto", "kernel", "sdpa"] = "auto"  # CPU fp32 full-pass attention: ours or the flash kernel; auto: measured
    decode: Literal["auto", "eager", "compiled"] = "auto"  # sampler decode step's layer body; auto: compiled on CUDA, measured on CPU
    decode_gemm: Literal["auto", "plain", "packed"] = "auto"  # CPU bf16 decode GEMMs: F.linear or on oneDNN-packed weights; auto: measured
    remeasure: bool = False                           # ignore this machine's cached measurement and measure again


@dataclass
class Precision:
    """A resolved choice; plain strings so it pickles to workers and saves as JSON."""
    dtype: str = "fp32"      # "fp32" | "bf16"
    gemm: str = "aten"       # "onednn" | "aten" (CPU fp32 GEMMs)
    kv: str = "fp32"         # "fp32" | "bf16"
    attention: str = "kernel"  # "kernel" | "sdpa" (CPU fp32 full passes)
    decode: str = "eager"      # "eager" | "compiled" (the sampler's decode step)
    decode_gemm: str = "plain"  # "plain" | "packed" (the sampler's CPU bf16 decode GEMMs)
    why: str = ""            # one line: what decided it
    cpu: dict = field(default_factory=dict)       # model name, bf16-relevant flags, torch capability
    measured: dict = field(default_factory=dict)  # GFLOP/s and attention ms, when measured

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv]

    def apply(self) -> "Precision":
        """Set this process's GEMM backend and attention kernel (call in every process that runs the model)."""
        set_onednn(self.gemm == "onednn")
        set_kernel(self.attention == "kernel")
        return self

    def load(self, name_or_path: str, device="cpu", role: str = "generator", tokenizer: bool = True,
             frozen: bool = False):
        """(model, tokenizer) set up for `role`: "trainer" keeps fp32 master weights and runs
        forward passes under autocast to `dtype`; "generator" (sampler, reference) holds
        weights in `dtype`. Both sample with a KV cache in `kv`. `frozen` (a trainer whose weights
        do not train: LoRA's base): the weights read in `dtype` at once, no fp32 copy on the way."""
        if role not in ("trainer", "generator"):
            raise ValueError(f"Precision.load: role={role!r}, expected 'trainer' or 'generator'")
        model, tok = load_model(name_or_path, device=device, tokenizer=tokenizer,
                                dtype=torch.float32 if role == "trainer" and not frozen else self.torch_dtype)
        return self.configure(model, role), tok

    def configure(self, model, role: str):
        if role == "trainer":
            model.compute_dtype = None if self.dtype == "fp32" else self.torch_dtype
        model.kv_dtype = self.kv_dtype
        model.decode_compile = self.decode == "compiled"
        model.decode_packed = self.decode_gemm == "packed"
        return model

    def inference_copy(self, model):
        """The trainer's model as a generator would hold it (for evaluation in the trainer):
        the model itself in fp32, else a copy in `dtype` (fp32 weights would run at fp32 speed)."""
        if model.dtype == self.torch_dtype and model.compute_dtype is None:
            return model
        m = copy.deepcopy(model).to(self.torch_dtype)
        m.compute_dtype = None
        return m

    def summary(self) -> str:
        return (f"dtype={self.dtype} gemm={self.gemm} kv={self.kv} attention={self.attention} decode={self.decode} "
                f"decode_gemm={self.decode_gemm} ({self.why})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Precision":
        """A saved `to_dict()`. One saved before `attention` existed ran SDPA: replaying it keeps that."""
        return cls(**{"attention": "sdpa", **d})


def resolve(cfg: PrecisionConfig, device: str = "cpu") -> Precision:
    """Turn `auto`s into concrete choices for this machine (see the module docstring)."""
    if torch.device(device).type == "cuda":
        dtype = "bf16" if cfg.dtype == "auto" else cfg.dtype
        kv = dtype if cfg.kv == "auto" else cfg.kv
        gemm = cfg.gemm if cfg.gemm != "auto" else "aten"
        decode = "compiled" if cfg.decode == "auto" else cfg.decode
        if cfg.decode_gemm == "packed":
            raise ValueError("precision.decode_gemm=packed is for CPU bf16 decode (oneDNN); on CUDA use plain or auto")
        return Precision(dtype, gemm, kv, "sdpa", decode, "plain", why="CUDA: bf16 autocast with fp32 master weights, "
                         "compiled decode, unless forced")
    info = cpu_info()
    hw = has_bf16_hardware(info)
    need = (cfg.gemm == "auto" or cfg.dtype == "auto" or cfg.attention == "auto"
            or ((cfg.kv == "auto" or cfg.decode_gemm == "auto") and cfg.dtype != "fp32"))
    m = measured(info, bf16=hw or cfg.dtype == "bf16", remeasure=cfg.remeasure) if need else {}
    why = []
    gemm = cfg.gemm
    if gemm == "auto":
        gemm = "onednn" if onednn_faster(m) else "aten"
        why.append(f"trainer fp32 GEMMs oneDNN {m.get('fp32_onednn_train_ms', math.nan):.1f} vs ATen "
                   f"{m['fp32_aten_train_ms']:.1f} ms (forward GEMM {m.get('fp32_onednn_gflops', 0.0):.0f} vs "
                   f"{m['fp32_aten_gflops']:.0f} GFLOP/s)")
    dtype = cfg.dtype
    if dtype == "auto":
        fp32_best = max(m["fp32_aten_gflops"], m.get("fp32_onednn_gflops", 0.0))
        if not hw:
            dtype = "fp32"
            why.append("no AMX-BF16 / AVX512-BF16: fp32")
        else:
            gain = m["bf16_gflops"] / fp32_best
            dtype = "bf16" if gain >= BF16_MIN_GAIN else "fp32"
            why.append(f"bf16 GEMM {gain:.2f}x fp32 (need {BF16_MIN_GAIN}x)")
    kv = cfg.kv
    if kv == "auto":
        if dtype == "fp32":
            kv = "fp32"
        else:
            kv = "bf16" if m["attn_bf16_ms"] < m["attn_fp32_ms"] else "fp32"
            why.append(f"decode attention bf16 {m['attn_bf16_ms']:.2f} vs fp32 {m['attn_fp32_ms']:.2f} ms")
    attention = cfg.attention
    if attention == "auto":
        ours, sdpa = m["full_attn_kernel_ms"], m["full_attn_sdpa_ms"]
        attention = "kernel" if ours < sdpa else "sdpa"
        why.append(f"causal attention kernel {ours:.1f} vs SDPA {sdpa:.1f} ms")
    decode = cfg.decode
    if decode == "auto":  # read, never measured here: the measurement compiles (module docstring)
        m = {**m, **cached_decode(info)}
        gain = m.get(f"decode_{dtype}_compiled_over_eager_tok_s")
        if gain is None:
            decode = "eager"
            why.append(f"decode eager: not measured on this machine ({DECODE_COMMAND}, ~1 min once)")
        else:
            decode = "compiled" if gain >= DECODE_MIN_GAIN else "eager"
            why.append(f"decode {decode}: compiled {gain:.2f}x eager, measured (need {DECODE_MIN_GAIN}x)")
    decode_gemm = cfg.decode_gemm
    if decode_gemm == "packed" and (dtype != "bf16" or not bf16_packing_available()):
        raise ValueError(f"precision.decode_gemm=packed needs bf16 decode on a CPU whose PyTorch packs bf16 for oneDNN "
                         f"(here: dtype={dtype}, packing {'available' if bf16_packing_available() else 'unavailable'})")
    if decode_gemm == "auto":
        if dtype != "bf16":
            decode_gemm = "plain"  # nothing to choose (as kv in fp32)
        elif "bf16_decode_packed_ms" not in m:
            decode_gemm = "plain"
            why.append("decode GEMMs plain: bf16 packing unavailable")
        else:
            plain, packed = m["bf16_decode_gemm_ms"], m["bf16_decode_packed_ms"]
            decode_gemm = "packed" if plain >= DECODE_GEMM_MIN_GAIN * packed else "plain"
            why.append(f"decode GEMMs {decode_gemm}: F.linear {plain:.2f} vs packed {packed:.2f} ms "
                       f"(need {DECODE_GEMM_MIN_GAIN}x)")
    return Precision(dtype, gemm, kv, attention, decode, decode_gemm, why="; ".join(why) or "all forced", cpu=info,
                     measured=m)


def machine_precision(device: str = "cpu") -> Precision:
    """What a run on this machine picks (`auto` everywhere: measured once per machine, ~2-3 s,
    then read from the cache), applied to this process (GEMM backend, attention kernel) and
    returned. Load a model through it to get the run's dtype as well (bf16 autocast over fp32
    weights where the machine measured bf16 faster): `machine_precision().load(path, role="trainer")`."""
    return resolve(PrecisionConfig(), device).apply()
