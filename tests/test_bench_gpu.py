"""bench/gpu.py in smoke mode on the CPU: every section runs end to end on tiny shapes and the one
JSON line on stdout carries each section's figures as finite numbers (the GPU run uses the same code
at full size; what only CUDA exercises is listed in bench/gpu.py's docstring)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# section -> {sub-dict (None = the section itself): numeric keys that must be finite}
EXPECTED = {
    "sampler": {"ours_eager": ("tok_s", "seconds", "tokens", "warmup_s"), "hf_dynamic": ("tok_s", "seconds", "tokens"),
                "hf_static": ("tok_s", "seconds", "tokens"), None: ("ours_over_hf_dynamic", "ours_over_hf_static")},
    "decode": {"ours_eager": ("wall_ms", "gpu_ms", "wall_over_gpu", "rows", "wall_ms_back_to_back", "back_to_back_over_gpu")},
    "trainer": {"no_checkpointing": ("step_s", "tok_s", "peak_gib"), "checkpointing": ("step_s", "tok_s", "peak_gib"),
                "shared_prompts": ("step_s", "tok_s", "peak_gib")},
    "ipc": {None: ("publish_ms", "apply_ms", "publish_from_fp32_master_ms", "param_bytes", "race_reads", "torn_reads")},
    "async": {None: ("steps", "steps_per_s", "gen_tok_s", "gen_syncs", "wait_frac", "trainer_tok_s")},
    "long": {None: ("rows_paged_over_static", "sampler_paged_over_static", "short_paged_over_static")},
}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_gpu_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "ASYNCRL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--device", "cpu", "--dtype", "fp32",
                        "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, p.stdout[-2000:]  # stdout is the JSON line only
    res = json.loads(lines[0])
    assert res["complete"] and res["smoke"] and res["machine"]["device"] == "cpu"
    assert json.loads(out.read_text()) == res  # --out holds the same record
    for section, parts in EXPECTED.items():
        assert "error" not in res[section], res[section].get("traceback")
        for part, keys in parts.items():
            d = res[section] if part is None else res[section][part]
            bad = {k: d.get(k) for k in keys if not _finite(d.get(k))}
            assert not bad, (section, part, bad)
    s = res["sampler"]
    assert s["ours_eager"]["all_full_length"] and s["ours_eager"]["tokens"] == s["hf_static"]["tokens"]
    assert "skipped" in s["hf_static_compiled"] and "skipped" in s["ours_cuda_graphs"]  # no compile / graphs on CPU
    g = s["gsm8k"]  # the ragged, stop-token workload: samples of different lengths, a ratio to transformers
    assert _finite(g["ours_eager"]["tok_s"]) and _finite(g["ours_over_hf_static"]) and not g["ours_eager"]["all_full_length"]
    assert _finite(s["engine"]["ours_no_sharing_over_hf_static"]) and s["engine"]["ours_no_sharing"]["prefill_tokens"] > \
        s["ours_eager"]["prefill_tokens"]  # no prompt sharing: every sample prefills its own copy
    sched = res["decode"]["gsm8k_schedule"]  # bucket shapes (eager on CPU) vs live shapes over the same schedule
    assert _finite(sched["captured_over_live_gpu"]) and sched["captured"]["run_prompt_rows"] >= sched["live"]["run_prompt_rows"]
    assert "captured_over_live_gpu" in res["targets"]
    assert res["ipc"]["torn_reads"] == 0 and res["ipc"]["race_reads"] >= 1
    assert res["async"]["steps"] == 3
    assert set(res["targets"]) >= {"comparable", "decode_wall_over_gpu", "trainer_no_checkpointing", "ipc",
                                   "long_rows_paged_over_static", "long_short_paged_over_static"}
    assert res["targets"]["comparable"] is False


def _run_gpu_main(tmp_path, section_body: str) -> dict:
    """bench/gpu.py's main at smoke size on CPU with its decode section replaced by `section_body`
    (the body of `decode(ctx)`); returns the record it left in --out."""
    out = tmp_path / "gpu.json"
    code = f"""
import os, sys; sys.path.insert(0, {str(ROOT)!r})
import bench.gpu as g
def decode(ctx):
{section_body}
g.SECTIONS["decode"] = decode
g.main(["--smoke", "--device", "cpu", "--only", "decode", "--out", {str(out)!r}])
"""
    env = {**os.environ, "ASYNCRL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 9), p.stderr[-3000:]
    return json.loads(out.read_text())


# parts reported the way the sampler section reports them: one workload's branch at a time
PARTS = """    ctx.progress("default ours", {"default": {"ours_cuda_graphs": {"tok_s": 5.0}}})
    ctx.progress("gsm8k ours", {"gsm8k": {"ours_cuda_graphs": {"tok_s": 3.0}}})
    ctx.progress("default hf", {"default": {"hf_static": {"tok_s": 1.0}}})
"""
KEPT = {"default": {"ours_cuda_graphs": {"tok_s": 5.0}, "hf_static": {"tok_s": 1.0}},
        "gsm8k": {"ours_cuda_graphs": {"tok_s": 3.0}}}


def test_a_section_that_raises_keeps_its_finished_parts(tmp_path):
    """A section that fails after some parts finished keeps every one of them beside the error,
    branches reported apart merged: a short GPU lease loses only what failed."""
    d = _run_gpu_main(tmp_path, PARTS + '    raise RuntimeError("the schedule failed")')["decode"]
    assert d.pop("error") == "RuntimeError: the schedule failed" and d.pop("traceback")
    assert d == KEPT


def test_a_section_killed_midway_leaves_its_finished_parts_on_disk(tmp_path):
    """A section killed by the lease's time limit (here: the process ends at once) leaves in --out
    every part it had finished, marked partial, not only the last one reported."""
    r = _run_gpu_main(tmp_path, PARTS + "    os._exit(9)")
    assert r["complete"] is False and r["decode"].pop("partial") is True
    assert r["decode"] == KEPT
