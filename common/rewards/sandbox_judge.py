"""The judge of one program in the code sandbox: a fork of the sandbox's server (sandbox_server.py:
the processes and what each may do), in a session of its own; never imported by the project, the
standard library and its siblings only.

It holds the result pipe, forks the program's process (sandbox_program.py), runs the dataset's
tests, each call of the program's functions a message to it, and writes each test's verdict with the
job's nonce. It never runs a line of the program, so nothing the program does can change a verdict;
at the end it kills the program's process.
Tests: HumanEval's `check(candidate)` (each `assert` of its body counted on its own; check()
finishing counts as the one test where every assert is in a loop), MBPP's assert statements, calls
with expected values (DeepCoder's fn_name cases) or stdin/stdout cases (DeepCoder, LiveCodeBench:
the program runs once per case). The tests see the program's functions by name (HumanEval's call
helpers of its prompt), never one named as a builtin (a program's own abs() would judge itself). A
test that takes longer than its limit fails, and with it those after it.
"""
import ast
import builtins
import ctypes
import json
import os
import select
import signal

from sandbox_program import _encode, _now, _program, _receive, _send

_JUDGE_NAMES = {"check", "candidate", "__verdict__"}  # the judge's own names in the tests' namespace


# ------------------------------------------------------------------ the judge
class _Program:
    """The judge's side of the program's process: calls in, answers out, each within the time limit."""

    def __init__(self, calls: int, answers: int, timeout: float):
        self.calls, self.answers, self.timeout, self.dead = calls, answers, timeout, False

    def ask(self, req):
        if self.dead:
            raise TimeoutError("the program stopped answering")
        _send(self.calls, req)
        rep = _receive(self.answers, _now() + self.timeout)
        if rep is None:  # too slow, gone, or not a literal: this test and every later one fail
            self.dead = True
            raise TimeoutError("no answer from the program")
        if rep[0] != "ok":
            raise RuntimeError(f"the program raised {rep[1]}")
        return rep[1]


def _counted_check(test_src: str):
    """HumanEval's test source with each top-level `assert` of check()'s body a verdict of its own:
    `assert X` -> `__verdict__(i, lambda: X)`. Returns (the compiled module, the number of asserts)."""
    tree = ast.parse(test_src)
    n = 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            for i, stmt in enumerate(node.body):
                if isinstance(stmt, ast.Assert):
                    lam = ast.Lambda(ast.arguments([], [], None, [], [], None, []), stmt.test)
                    node.body[i] = ast.copy_location(
                        ast.Expr(ast.Call(ast.Name("__verdict__", ast.Load()), [ast.Constant(n), lam], [])), stmt)
                    n += 1
    return compile(ast.fix_missing_locations(tree), "<tests>", "exec"), n


def _judge(job: dict, prog: _Program, say) -> list:
    """Every test's verdict (module docstring), each said as it is known."""
    kind, tests, verdicts = job["kind"], job["tests"], []

    def verdict(i, test):
        try:
            ok = bool(test())
        except BaseException:  # noqa: BLE001 - the assert failed, or the call did
            ok = False
        verdicts.append(ok)
        say({"test": i, "ok": ok})

    # the program's functions as the tests see them: each a call into the program's process (HumanEval's
    # tests call helpers of the prompt, e.g. poly() or encode_cyclic(), as MBPP's call the solution)
    # and never a builtin's name: a program's own abs() or set() would answer the tests' comparisons
    try:
        names = [k for k in (prog.ask(("names",)) if kind in ("check", "asserts") else [])
                 if type(k) is str and k.isidentifier() and not hasattr(builtins, k) and k not in _JUDGE_NAMES]
    except (TimeoutError, RuntimeError):
        names = []
    ns = {"__builtins__": builtins, **{k: (lambda k: lambda *a: prog.ask(("call", k, _encode(a))))(k) for k in names}}
    if kind == "check":
        code, n = _counted_check(tests)
        ns["__verdict__"] = verdict
        try:
            exec(code, ns)
            ns["check"](lambda *a: prog.ask(("call", job["entry_point"], _encode(a))))
            if n == 0:  # every assert in a loop: check() finishing is the one test
                n = 1
                verdicts.append(True)
        except BaseException:  # noqa: BLE001 - check() stopped (an assert in a loop, a timeout): that fails too
            n += 1
            verdicts.append(False)
        return verdicts + [False] * (n - len(verdicts))
    if kind == "asserts":
        for i, src in enumerate(tests):
            verdict(i, lambda: exec(compile(src, f"<test {i}>", "exec"), dict(ns)) is None)
        return verdicts
    for i, case in enumerate(tests):
        if kind == "call":
            verdict(i, lambda: _same_value(prog.ask(("call", job["entry_point"], _encode(case["args"]))),
                                           case["output"]))
        else:
            verdict(i, lambda: _same_output(prog.ask(("run", case["input"])), case["output"]))
    return verdicts


def _same_value(got, want) -> bool:
    return got == want or (type(got) in (list, tuple) and type(want) in (list, tuple) and list(got) == list(want))


def _same_output(got: str, want: str) -> bool:
    """Outputs equal line by line, trailing whitespace and trailing blank lines aside."""
    def lines(s):
        return [line.rstrip() for line in s.strip("\n").split("\n")]
    return lines(got) == lines(want)


def judge_main(job: dict, result: int) -> None:
    """The judge (the module docstring), in a session of its own; never returns. `result`: the result
    pipe's write end."""
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the server gone, the judge goes
    nonce = job["nonce"]

    def say(obj):
        os.write(result, (json.dumps({**obj, "nonce": nonce}) + "\n").encode())
    calls_r, calls_w = os.pipe()
    answers_r, answers_w = os.pipe()
    alarm_r, alarm_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the program's process: its code can walk up to this frame, so it keeps neither the
        job.pop("tests")  # tests (their expected values) nor the nonce; the result pipe it closes (_program)
        job.pop("nonce")
        nonce = None
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # the judge gone, the program goes (before its code runs)
        os.close(calls_w)
        os.close(answers_r)
        os.close(alarm_r)
        _program(job, calls_r, answers_w, alarm_w)
    for fd in (calls_r, answers_w, alarm_w):
        os.close(fd)
    say({"start": True, "namespaced": job["namespaced"]})
    prog = _Program(calls_w, answers_r, job["limits"]["test_timeout_s"])
    first = _receive(answers_r, _now() + job["limits"]["test_timeout_s"])
    if first is None or first[0] != "ready":
        error = first[1] if first is not None else "the program did not start in time"
        verdicts, total = [], None
    else:
        error = None
        verdicts = _judge(job, prog, say)
        total = len(verdicts)
    violation = os.read(alarm_r, 400).decode(errors="replace") if select.select([alarm_r], [], [], 0)[0] else ""
    try:  # the program is done with, whatever it does now (a new session of its own included)
        os.kill(pid, 9)
    except OSError:
        pass
    say({"done": True, "passed": verdicts, "total": total, "error": error, "violation": violation,
         "timed_out": prog.dead})
    os._exit(0)
