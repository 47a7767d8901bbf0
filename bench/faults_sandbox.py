"""The faults table's attacks on the code sandbox (bench/faults.py runs them; the sandbox:
common/rewards/sandbox.py): each hostile program, as the policy could write it, judged as a user
meets it (`python run_code.py --judge=FILE`, a child process in a session of its own) beside what it
is after: a run folder with a checkpoint, the run's secret, a listener of the run on loopback. A row
reports the reward and the reason, how long the verdict took against the limit, what is left
(processes of the judge's group and of any sandbox, temporary folders) and what the attack must
not achieve (a file changed outside its folder, a connection to the listener). Then one row, all of
them during a training run (`attacks_during_a_run`: a tiny asynchronous AReaL run of run_code.py
whose every problem is an attack): the run goes on to its last step, the reasons counted in its
metrics.

    python bench/faults.py --only fork_bomb infinite_loop attacks_during_a_run
"""
from __future__ import annotations

import json
import socket
import sys
import tempfile
import time
from pathlib import Path

from bench._faults_util import ROOT, finish, spawn
from bench.leaks import shm_entries

TIMEOUT_S, TEST_TIMEOUT_S = 5.0, 2.0  # the rows' limits: --sandbox.timeout_s, --sandbox.test_timeout_s
LIMITS = [f"--sandbox.timeout_s={TIMEOUT_S}", f"--sandbox.test_timeout_s={TEST_TIMEOUT_S}", "--sandbox.cpu_s=4",
          "--sandbox.memory_mb=512", "--sandbox.file_mb=4"]
CHECK = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(5) == 6\n"


def programs(run: Path, secret: Path, port: int) -> dict[str, str]:
    """Each attack as a program whose f(x) the tests call (tests/test_sandbox.py runs the same table)."""
    return {
        "fork_bomb": "import os\ndef f(x):\n    while True:\n        os.fork()\n",
        "infinite_loop": "def f(x):\n    while True:\n        pass\n",
        "allocate_50gb": "def f(x):\n    a = bytearray(50 * 2**30)\n    return x + 1\n",
        "write_outside": f"def f(x):\n    open({str(run / 'pwned.txt')!r}, 'w').write('x')\n    return x + 1\n",
        "read_secret": f"def f(x):\n    print(open({str(secret)!r}).read())\n    return x + 1\n",
        "read_checkpoint": f"def f(x):\n    open({str(run / 'checkpoints' / 'model.safetensors')!r}, 'rb').read()\n"
                           f"    return x + 1\n",
        "socket_to_the_run": f"import socket\ndef f(x):\n    socket.create_connection(('127.0.0.1', {port}))\n"
                             f"    return x + 1\n",
        "kill_parent": "import os\ndef f(x):\n    os.kill(os.getppid(), 9)\n    return x + 1\n",
        "background_process": "import os\ndef f(x):\n    os.system('sleep 300 &')\n    return x + 1\n",
        "sys_exit": "import sys\ndef f(x):\n    sys.exit(0)\n",
        "os_exit_mid_tests": "import os\ndef f(x):\n    if x > 1:\n        os._exit(0)\n    return x + 1\n",
        "print_gigabytes": "def f(x):\n    while True:\n        print('x' * 1000000)\n",
        "delete_files": f"import shutil\ndef f(x):\n    shutil.rmtree({str(run)!r})\n    return x + 1\n",
        "ctypes": "import sys\ndef f(x):\n    sys.modules['ctypes'].CDLL(None).system(b'sleep 300')\n    return x + 1\n",
        "always_equal": "class A:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return A()\n",
        "raise_limits": "import sys\ndef f(x):\n    r = sys.modules['resource']\n    r.setrlimit(r.RLIMIT_AS, (-1, -1))\n"
                        "    return x + 1\n",
        "read_the_tests": "import sys\ndef f(x):\n    fr = sys._getframe()\n    while fr is not None:\n"
                          "        if 'tests' in (fr.f_locals.get('job') or {}):\n            return x + 1\n"
                          "        fr = fr.f_back\n    return -1\n",  # found: it answers right, else wrong
    }


NAMES = list(programs(Path("r"), Path("s"), 1))
ATTACKS = {name: (f"a program the policy wrote: {name.replace('_', ' ')}, judged by run_code.py --judge",
                  r'"reward": 0\.0') for name in NAMES}
ATTACKS["attacks_during_a_run"] = ("every attack a problem of a tiny async AReaL run_code.py run (4 steps)",
                                   r"plot: .*curves\.png")  # the run's last line


class Victim:
    """What a program must not reach: a run folder with a checkpoint, the run's secret, a listener."""

    def __init__(self, d: Path):
        self.run, self.secret = d / "runs" / "victim", d / "secret"
        (self.run / "checkpoints").mkdir(parents=True)
        (self.run / "checkpoints" / "model.safetensors").write_text("weights")
        self.secret.write_text("the-run-secret")
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        self.srv.setblocking(False)
        self.port = self.srv.getsockname()[1]

    def harmed(self) -> dict:
        try:
            self.srv.accept()
            connected = True
        except BlockingIOError:
            connected = False
        files = sorted(str(p.relative_to(self.run)) for p in self.run.rglob("*")) if self.run.exists() else []
        return {"outside_written": files != ["checkpoints", "checkpoints/model.safetensors"]
                or self.secret.read_text() != "the-run-secret", "connected": connected}


def sandbox_processes() -> set[int]:
    """Live processes of any code sandbox (its server and what it forks), zombies aside."""
    out = set()
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and b"sandbox_server" in (p / "cmdline").read_bytes() and \
                    (p / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.add(int(p.name))
        except OSError:
            continue
    return out


def _problems(d: Path, attacks: dict[str, str] | None = None) -> Path:
    """One HumanEval-form problem per attack (the attack its prompt, the completion a comment), or one
    empty-prompt problem the judged completions continue."""
    rows = [{"task_id": f"attack/{k}", "prompt": v + "X = 0  # ", "test": CHECK, "entry_point": "f"}
            for k, v in attacks.items()] if attacks else [{"task_id": "attack", "prompt": "", "test": CHECK,
                                                           "entry_point": "f"}]
    path = d / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tmp_dirs() -> set:
    return set(Path(tempfile.gettempdir()).glob("asyncrl_sandbox_*"))


def run(name: str, d: Path, model: str) -> dict:
    """One row (module docstring)."""
    victim, shm, tmp, procs = Victim(d), shm_entries(), _tmp_dirs(), sandbox_processes()
    attacks = programs(victim.run, victim.secret, victim.port)
    log = d / "out.log"
    t0 = time.monotonic()
    if name == "attacks_during_a_run":
        p = spawn([sys.executable, str(ROOT / "run_code.py"), "--model=tiny", f"--data.path={_problems(d, attacks)}",
                   "--algo=areal", "--data.eval_size=0", "--data.prompt_style=plain", "--gen.n=4",
                   "--gen.max_new_tokens=2", "--train.steps=4", "--train.prompts_per_step=2", "--train.min_buffer=8",
                   "--train.checkpoint_every=0", f"--run_root={d / 'runs'}", "--name=code", *LIMITS], log)
    else:
        samples = d / "samples.jsonl"
        samples.write_text(json.dumps({"task_id": "attack", "completion": attacks[name]}) + "\n")
        p = spawn([sys.executable, str(ROOT / "run_code.py"), f"--judge={samples}", f"--data.path={_problems(d)}",
                   *LIMITS], log)
    res = finish({}, [p], [log], ATTACKS[name][1], t0, shm)
    time.sleep(0.2)
    res.update(victim.harmed(), sandbox_processes_left=len(sandbox_processes() - procs),
               tmp_dirs_left=len(_tmp_dirs() - tmp))
    res["processes_left"] += res["sandbox_processes_left"]
    if name == "attacks_during_a_run":
        rows = [json.loads(x) for x in (d / "runs" / "code" / "metrics.jsonl").read_text().splitlines()] \
            if (d / "runs" / "code" / "metrics.jsonl").exists() else []
        last = [r for r in rows if "reward_mean" in r][-1:] or [{}]
        res.update(steps=len([r for r in rows if "reward_mean" in r]), reward_mean_max=max(
            (r["reward_mean"] for r in rows if "reward_mean" in r), default=None),
            **{k: last[0].get(k) for k in ("reward_timeouts", "reward_crashes", "reward_refused")})
        res["detected"] = res["steps"] == 4 and res["exit_code"] == [0]
    else:
        verdict = next((json.loads(x) for x in log.read_text().splitlines() if x.startswith('{"task_id"')), {})
        res.update(reward=verdict.get("reward"), reason=verdict.get("reason"), verdict_s=verdict.get("seconds"),
                   within_limit=verdict.get("seconds", 1e9) < TIMEOUT_S + 1.0)
    victim.srv.close()
    return res
