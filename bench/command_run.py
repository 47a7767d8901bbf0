"""One whole command timed, as a user runs it, into one JSON line: a task script's run (wall time,
its run folder's last metrics, its evaluations and `eval_summary.json`, the precision it picked)
or the test suite (passed, failed, skipped, pytest's own seconds). The benchmark behind the
headline rows that are whole runs (BENCHMARKS.md: the main job, the Quick start's tiny run, the
tasks' default runs, the suite).

    python bench/command_run.py --run-dir runs/gsm8k_tba -- python run_gsm8k.py --overwrite
    python bench/command_run.py -- bash .ci/run

Runs the command in the repository root, its output passed through to stderr (a progress bar
stays visible); the JSON line goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.contracts.log import read_metrics  # noqa: E402
from common.engine.machine.cpu import cpu_info  # noqa: E402

_PYTEST = re.compile(r"=+ (.*?) in ([\d.]+)s")


def cpu_kind(info: dict | None = None) -> str:
    """A machine's name in bench/results' file names: the vendor and its widest vector unit
    ('epyc-avx512', 'epyc-avx2', 'xeon-amx', 'xeon-avx512')."""
    info = info or cpu_info()
    vendor = "epyc" if "AMD" in info["model"] else "xeon" if "Intel" in info["model"] else "cpu"
    flags = set(info["flags"])
    return f"{vendor}-{'amx' if 'amx_bf16' in flags else 'avx512' if 'avx512f' in flags else 'avx2'}"


def _pytest_summary(lines: list[str]) -> dict:
    """Counts and seconds of every pytest summary line the command printed (`.ci/run` runs two)."""
    out = []
    for line in lines:
        m = _PYTEST.search(line)
        if m and ("passed" in m[1] or "failed" in m[1]):
            counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", m[1])}
            out.append({**counts, "seconds": float(m[2])})
    return {"pytest": out} if out else {}


def _run_summary(d: Path) -> dict:
    """What a task run left in its folder: the last training row, every evaluation, the summary."""
    rows = read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").exists() else []
    steps = [r for r in rows if "step_s" in r]
    evals = [{k: v for k, v in r.items() if k.startswith("eval_") or k in ("step", "time")}
             for r in rows if any(k.startswith("eval_") for k in r)]
    out = {"steps": len(steps), "last_step": steps[-1] if steps else None, "evals": evals}
    for name in ("eval_summary.json", "precision.json"):
        if (d / name).is_file():
            out[name.removesuffix(".json")] = json.loads((d / name).read_text())
    if steps:
        out["mean_step_s"] = sum(r["step_s"] for r in steps) / len(steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=None, help="the run folder the command writes (its metrics are read)")
    ap.add_argument("--label", default="", help="what the line is called in BENCHMARKS.md")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command after --")
    t0, lines = time.monotonic(), []
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in p.stdout:
        sys.stderr.write(line)
        lines.append(line.rstrip("\n"))
    rc = p.wait()
    res = {"bench": "command_run", "label": a.label, "command": " ".join(cmd), "exit_code": rc,
           "wall_s": round(time.monotonic() - t0, 1), "date": time.strftime("%Y-%m-%d"), "cpu": cpu_kind(),
           "machine": cpu_info()["model"], "tail": lines[-3:], **_pytest_summary(lines)}
    if a.run_dir:
        res["run"] = _run_summary(ROOT / a.run_dir)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
