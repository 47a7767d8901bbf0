"""The profile of one trainer forward + backward for bench/trainer_floor.py: each operator's own time
by kind (GEMM, attention kernel, elementwise, copies, allocation, views, compiled, other) and by
model part (attention block, MLP, norms, head, the rest), forward and backward apart. Parts come
from module hooks installed here for the pass only (the model has none). Runs in the benchmark's
process; the profiler inflates small operations, so shares, not absolute times, are its figures.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from common.engine.model.layers import LayerNorm, RMSNorm
from common.engine.model.transformer import MLP, Attention
from common.contracts.ops import token_logp

_GEMM = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")
_COPY = ("aten::copy_", "aten::clone", "aten::_to_copy", "aten::cat", "aten::contiguous", "aten::index",
         "aten::masked_scatter_", "aten::index_put_", "aten::gather", "aten::scatter_add_", "aten::embedding_dense_backward")
_ALLOC = ("aten::empty", "aten::empty_strided", "aten::zeros", "aten::zero_", "aten::fill_", "aten::empty_like",
          "aten::resize_", "aten::new_zeros")


def kind(name: str) -> str:
    if name in _GEMM:
        return "gemm"
    if "flash_attention" in name or "scaled_dot_product" in name:
        return "attention_kernel"
    if name in _COPY:
        return "copy"
    if name in _ALLOC:
        return "alloc"
    if "cpp_fused" in name or name.startswith(("CompiledFunction", "Torch-Compiled", "## Call CompiledFxGraph")):
        return "compiled"
    if name.startswith("aten::"):
        return "elementwise" if name not in ("aten::view", "aten::reshape", "aten::t", "aten::transpose",
                                             "aten::as_strided", "aten::expand", "aten::slice", "aten::select",
                                             "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::split",
                                             "aten::chunk", "aten::detach", "aten::alias", "aten::_unsafe_view") else "views"
    return "other"


def profile(model, tokens, mask, T) -> dict:
    """Own time by (direction, part, kind), in seconds (module docstring)."""
    enter, leave = torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit
    handles, open_ = [], {}
    for mod in model.modules() if not model.compile_blocks else ():  # no hooks inside compiled code
        part = {Attention: "attention", MLP: "mlp", RMSNorm: "norm", LayerNorm: "norm"}.get(type(mod))
        if part is None:
            continue

        def pre(m, args, part=part, direction="fwd"):
            open_.setdefault(id(m), []).append(enter(f"part:{direction}:{part}"))

        def post(m, args, out):
            leave(open_[id(m)].pop())
        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post),
                    mod.register_full_backward_pre_hook(lambda m, g, part=part: pre(m, None, part, "bwd")),
                    mod.register_full_backward_hook(lambda m, gi, go: post(m, None, None))]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("part:fwd:rest"):
            lp = token_logp(model, tokens, T, mask).sum()
        with torch.profiler.record_function("part:bwd:rest"):
            lp.backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.name.startswith("part:"):
            continue
        p, label = e.cpu_parent, None
        while p is not None and label is None:
            if p.name.startswith("part:") and not p.name.endswith(":rest"):
                label = p.name[5:]
            elif "_HeadLogp" in p.name:
                label = None
                break
            p = p.cpu_parent
        if label is None:  # head (inside _HeadLogp) or the rest: which pass from the outer range
            q, head = e.cpu_parent, False
            while q is not None:
                head = head or "_HeadLogp" in q.name
                if q.name in ("part:fwd:rest", "part:bwd:rest"):
                    break
                q = q.cpu_parent
            direction = "bwd" if (q is not None and "bwd" in q.name) or "Backward" in e.name else "fwd"
            label = f"{direction}:{'head' if head else 'rest'}"
        out[f"{label}:{kind(e.name)}"] += e.self_cpu_time_total / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
