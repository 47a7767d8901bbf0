"""bench/decode_attention.py: its plain-ops alternative computes the sampler's decode attention (so
timing the two compares equal work), and a quick run reports per-step figures consistent with its
per-call ones."""
import json
import subprocess
import sys
from pathlib import Path

import torch

from bench.decode_attention import plain_attention
from common.engine.model.attention import additive_mask, attend_lse

ROOT = Path(__file__).resolve().parents[1]


def test_plain_attention_equals_the_kernel_on_ragged_rows():
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, S, hd = 5, 3, 3, 11, 16
    q, k, v = (torch.randn(*s, generator=g) for s in ((B, Hkv, G, hd), (B, Hkv, S, hd), (B, Hkv, S, hd)))
    lens = torch.tensor([1, 4, 11, 7, 2])  # row b sees its first lens[b] columns
    mask = additive_mask((torch.arange(S)[None] < lens[:, None])[:, None, None, :], torch.float32)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        ref_o, ref_l = attend_lse(q.to(dt), k.to(dt), v.to(dt), mask.to(dt))
        o, lse = plain_attention(q.to(dt), k.to(dt), v.to(dt), mask.to(dt))
        assert o.dtype == dt and lse.dtype == torch.float32
        torch.testing.assert_close(o.float(), ref_o.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_l, atol=1e-4, rtol=1e-4)
    # row 0 sees one column: its output is that column's value, its lse that one score
    o, lse = plain_attention(q, k, v, mask)
    torch.testing.assert_close(o[0], v[0, :, :1].expand(Hkv, G, hd))
    torch.testing.assert_close(lse[0], (q[0] @ k[0, :, :1].transpose(-1, -2)).squeeze(-1) * hd ** -0.5)


def test_quick_run_reports_consistent_figures():
    out = subprocess.run([sys.executable, "bench/decode_attention.py", "--quick"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    r = json.loads(out.strip().splitlines()[-1])
    ms = r["ms"]
    assert set(ms) == {"own_cold", "own_warm", "own_small", "prompt_cold", "prompt_warm", "floor"}
    assert all(v > 0 for v in ms.values())
    assert abs(r["step_ms"] - r["layers"] * (ms["own_cold"] + ms["prompt_cold"])) <= 0.051  # rounded to 0.1
    assert r["own"]["pairs"] == r["own"]["rows"] * 3 and r["prompt"]["queries_per_pair"] == 2 * 3
    # the share is rounded to 1e-3 and the ms it is recomputed from to 1e-4 (half a unit each way):
    # the bound is those roundings carried through 1 - warm / cold, so it holds at any speed
    w, c = ms["own_warm"], ms["own_cold"]
    slack = 5e-4 + 5e-5 / (c - 5e-5) + (w + 5e-5) * 5e-5 / (c - 5e-5) ** 2
    assert abs(r["own_stall_share"] - (1 - w / c)) <= slack + 1e-9
