"""How close is close enough, when two computations of the same training differ only in float
rounding (2 ranks vs 1, micro-batch splits, a replay on other kernels).

fp32 sums taken in another order differ by a few ulps, and the optimizer can magnify that: AdamW's
first steps move each weight by about lr * g / (|g| + eps), so where one gradient element is near
zero its update can change by up to 2 lr (seen: 1.3e-5 on one o_proj weight with lr 1e-3, two
ranks vs one, on an AVX-512 EPYC; 1.1e-8 on another machine). A fixed absolute bound on the worst
element is therefore a bound on luck. What rounding cannot do is move a whole tensor: the bound
here is on each tensor's norm, relative to how far the training moved it,

    ||a - b|| <= rel * ||a - before|| + floor * ||before||,

the floor (a few fp32 ulps of the weight) covering a tensor the training barely moved. A real
bug (a shard's update missing, a rank's gradient not reduced, a micro-batch counted twice) moves
the tensor by the order of its update: a ratio near 1, far above `rel`.
"""
from __future__ import annotations

import torch

REL = 1e-2  # measured worst across ranks / splits: ~4e-4 (a 64-element bias), ~2e-4 on the o_proj above
FLOOR = 1e-6  # ~8 fp32 ulps of the weight's norm


def assert_update_close(before, a, b, rel: float = REL, floor: float = FLOOR, msg: str = "") -> None:
    """`a` and `b` (tensors, or dicts of them with the same keys) are the same training's result up
    to float rounding: for each tensor, ||a - b|| <= rel * ||a - before|| + floor * ||before||
    (see the module's docstring)."""
    if isinstance(a, torch.Tensor):
        before, a, b = {"": before}, {"": a}, {"": b}
    assert a.keys() == b.keys(), (msg, sorted(a.keys() ^ b.keys()))
    bad = []
    for k in a:
        x, y, x0 = (t.detach().double() for t in (a[k], b[k], before[k]))
        assert x.shape == y.shape == x0.shape, (msg, k, x.shape, y.shape, x0.shape)
        gap, upd = (x - y).norm().item(), (x - x0).norm().item()
        if not gap <= rel * upd + floor * x0.norm().item():  # `not <=`: a NaN fails
            bad.append(f"{k}: ||a-b|| {gap:.3g} vs ||update|| {upd:.3g} (ratio {gap / upd if upd else float('inf'):.3g}"
                       f" > {rel:g}); max |a-b| {(x - y).abs().max().item():.3g}, max |update| "
                       f"{(x - x0).abs().max().item():.3g}")
    assert not bad, f"{msg + ': ' if msg else ''}{len(bad)} tensor(s) differ by more than rounding:\n" + "\n".join(bad)


def assert_scaled_close(actual, expected, rel: float = 1e-5, scale: float | None = None, rtol: float = 0.0,
                        msg: str = "") -> None:
    """`actual` equals `expected` to within `rel` of a scale, element by element (plus `rtol` of each
    element): for values (log-probs, gradients) that two reduction orders compute, where a fixed
    absolute bound is too loose for small values and too tight for large ones. `scale`: the
    largest magnitude of `expected` unless given (a gradient's: the whole model's, since a tensor's
    own sum may cancel down to less than the terms whose rounding it carries)."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    if scale is None:
        scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rel * scale + 1e-30, msg=msg or None)


def grad_scale(grads: dict) -> float:
    """The largest gradient magnitude over all of a model's tensors: the scale of its rounding."""
    return max(g.detach().abs().max().item() for g in grads.values() if g.numel())
