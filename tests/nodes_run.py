"""Helpers for the several-node tests (tests/test_nodes.py, tests/test_node_faults.py): run
tests/nodes_toy.py under two torchrun agents on 127.0.0.1, find every process a run started,
read what it wrote.

Every agent runs in its own session; torchrun starts its worker in another session of its own
and the worker's generators are its children, so "nothing left running" is checked on the pids
the run itself lists (`run_pids`: the trainer's workers.json, each generator node's
node<rank>/workers.json), not on the agents' sessions alone.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.leaks import wait_until
from common.contracts.log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "nodes_toy.py"
RUN_S = 150  # bound on one two-node run (they take ~15-25 s on 2 busy cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SECRET = "tests-" + "0123456789abcdef" * 2  # the run's secret every node of a test run shares (wire.run_secret)


def env(**extra) -> dict:
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "ASYNCRL_RUN_SECRET": SECRET, **extra}


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not count: it runs nothing and holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return False
    except ProcessLookupError:
        return True


def start(cmds: list[list[str]], logs: Path, **extra) -> list[subprocess.Popen]:
    """Start the commands side by side, each in its own session, output to logs/out<i>.txt."""
    logs.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(c, cwd=ROOT, env=env(**extra), stdout=open(logs / f"out{i}.txt", "w"),
                             stderr=subprocess.STDOUT, start_new_session=True) for i, c in enumerate(cmds)]


def output(logs: Path, n: int = 2) -> list[str]:
    return [(logs / f"out{i}.txt").read_text() if (logs / f"out{i}.txt").exists() else "" for i in range(n)]


def finish(procs: list[subprocess.Popen], logs: Path, ok: bool | list[bool] = True, bound_s: float = RUN_S) -> list[str]:
    """Wait for the commands (at most bound_s); their output. ok: every command must exit 0 (else:
    none may), or one such flag per command. Whatever is left of their sessions is SIGKILLed at the
    end, and a run that left one fails."""
    deadline = time.monotonic() + bound_s
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
        out = output(logs, len(procs))
        for p, o, good in zip(procs, out, ok if isinstance(ok, list) else [ok] * len(procs)):
            assert (p.returncode == 0) == good, o[-4000:]
        t = time.monotonic() + 10
        while not all(_gone(p.pid) for p in procs) and time.monotonic() < t:
            time.sleep(0.1)
        assert all(_gone(p.pid) for p in procs), "a process outlived its node"
        return out
    finally:
        for p in procs:
            if not _gone(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def agent(port: int, *args, torchrun: tuple = (), node_rank: int | None = None, nnodes: int = 2,
          trainer_nodes: int = 1) -> list[str]:
    """One torchrun agent of an `nnodes`-node world running the toy with `args`: c10d rendezvous (roles
    by arrival), or with `node_rank` the static one, where node 0 (the trainer) hosts torchrun's
    store, as a deployment pointing --master-addr at the trainer's machine does."""
    how = (["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1"] if node_rank is None
           else ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}", f"--node-rank={node_rank}"])
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1", *how, *torchrun,
            str(SCRIPT), f"--dist.trainer_nodes={trainer_nodes}", *args]


def logs_dir(tmp_path: Path) -> Path:
    return tmp_path / f"agents{len(list(tmp_path.glob('agents*')))}"  # one folder per run


def two_nodes(tmp_path: Path, *args, ok: bool = True, torchrun: tuple = (), nnodes: int = 2, trainer_nodes: int = 1,
              **extra) -> list[str]:
    """Run the toy on two nodes (or `nnodes`) to its end; every agent's output."""
    cmd = agent(free_port(), *args, torchrun=torchrun, nnodes=nnodes, trainer_nodes=trainer_nodes)
    logs = logs_dir(tmp_path)
    return finish(start([cmd] * nnodes, logs, **extra), logs, ok)


def run_pids(run_dir: Path) -> dict[str, int]:
    """name -> pid of every process the run listed: the trainer and its workers, each generator
    node's main process and its generators."""
    pids = {}
    for f in [run_dir / "workers.json", *sorted(run_dir.glob("node*/workers.json"))]:
        if f.exists():
            where = "" if f.parent == run_dir else f"{f.parent.name}/"  # the trainer's, or node<rank>/
            pids.update({where + k: v for k, v in json.loads(f.read_text()).items()})
    return pids


def wait_for(what, timeout: float, every: float = 0.1):
    """Poll `what()` until it returns something true (returned) or `timeout` s pass (AssertionError):
    `bench/leaks.wait_until`, which returns None instead."""
    got = wait_until(what, timeout, every)
    if not got:
        raise AssertionError(f"not within {timeout} s: {getattr(what, '__doc__', None) or what}")
    return got


def weights(run_root: Path) -> dict:
    """The run's last checkpoint's weights."""
    return weights_of(sorted((run_root / "toy" / "checkpoints").glob("step_*"))[-1] / "model")


def weights_of(model_dir: Path) -> dict:
    """The weights in a model folder's safetensors files (the run's starting model, a checkpoint's)."""
    from safetensors.torch import load_file  # only these tests read a checkpoint's files directly
    return {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def steps(run_root: Path) -> list[dict]:
    path = run_root / "toy" / "metrics.jsonl"
    return [r for r in read_metrics(path) if "staleness_hist" in r] if path.exists() else []
