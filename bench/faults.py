"""Fault injection: what the runtime does when a worker dies or hangs, a reward misbehaves, the
trainer is killed mid-checkpoint, the user presses Ctrl-C, a data line is malformed, the disk
fills up, or one of two trainer ranks (train.trainer_devices=2) dies, raises or hangs; then the
attacks and mistakes: on the run's store across nodes (bench/faults_store.py: a forged value, a
replayed one, an earlier run's, a wildcard address through MASTER_ADDR, a weak secret) and on files
and command lines (bench/faults_attacks.py: a planted checkpoint or buffer, a buffer of absurd size, a
truncated weight file, a hostile run name, --overwrite over a user's file, a really full disk, a
zero-size setting) and on the code sandbox (bench/faults_sandbox.py: each hostile program the policy
could write, and all of them during a run). Prints one JSON line per scenario and a summary line (stdout), and a table
(stderr).

    python bench/faults.py                                 # every scenario, ~6 min on 2 cores
    python bench/faults.py --only generator_sigkill ctrl_c

Each scenario is a real training job (`common.train.train`, TBA, one generator process, a
tiny random Llama, a toy reward) run as a child process (this file with --child) in a session of
its own, so the parent can signal and count its whole process group. The parent waits until the
job has trained a few steps, injects the fault, times how long until the job reports it (its exit
with the expected message, or the metrics counting it), then inspects what is left: processes
of the group, new /dev/shm entries of the job's (another program's are not counted), every checkpoint (each one loaded), the replay-buffer rows in
the latest checkpoint (ring holes or duplicates), and, for faults that stop the run, whether a
`--resume` run without the fault continues from the latest checkpoint's step and version and
keeps every buffer row of it.

Injection: signals from the parent (SIGKILL, SIGSTOP, SIGINT to the group); reward faults through
a marker file the toy reward reads on every call (the spawned generator inherits its path);
checkpoint faults inside the child (a checkpoint write made slow so that SIGKILL lands mid-write,
or an OSError(ENOSPC) from the second checkpoint's write: a simulated full disk).
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402
from common.engine.checkpoints.tiny_model import build_tiny  # noqa: E402 - the toy task's model
from bench.leaks import group_alive, leaked, shm_entries, wait_until  # noqa: E402 - the run's own /dev/shm entries only
from bench import faults_attacks, faults_sandbox, faults_store  # noqa: E402
from tba.algo import TBA  # noqa: E402  (PacedTBA must be a module-level class: ranks 1..N-1 unpickle it)

STEPS, INJECT_AT, STALL_S, PACE_S, LOW = 60, 3, 5.0, 0.1, 20  # 60 paced steps (~8 s) outlast a 5 s stall
# name -> (how the fault is injected, does the run stop?, regex the job's output must hold when it is detected)
SCENARIOS = {
    "generator_sigkill": ("SIGKILL generator0", True, r"worker 'generator0' died .*SIGKILL"),
    "generator_sigstop": ("SIGSTOP generator0 (a hang)", True, r"'generator0'.*process is stopped"),
    "reward_raises": ("reward fn raises from now on", False, None),
    "reward_hangs": ("reward fn blocks forever", True, r"'generator0'.*phase 'scoring'"),
    "reward_worker_sigkill": ("SIGKILL reward0 (train.reward_workers=1)", True, r"worker 'reward0' died .*SIGKILL"),
    "trainer_sigkill_in_checkpoint": ("SIGKILL the trainer while it writes a checkpoint", True, None),
    "ctrl_c": ("SIGINT to the process group", True, r"interrupted \(Ctrl-C or SIGTERM\) at step \d+: checkpoint"),
    "nan_reward": ("reward fn returns NaN from now on", False, None),
    "malformed_data_line": ("run_gsm8k.py on a train.jsonl whose line 3 is cut", True, r"train\.jsonl:3: malformed JSON"),
    "disk_full_in_checkpoint": ("OSError(ENOSPC) while writing the 2nd checkpoint", True,
                                r"could not write checkpoint .*No space left.*previous checkpoint .* is intact"),
    "trainer_rank_sigkill": ("SIGKILL trainer rank 1 of 2", True, r"worker 'trainer1' died .*SIGKILL"),
    "trainer_rank_raises": ("trainer rank 1 of 2 raises in backward", True, r"worker 'trainer1' failed:.*injected"),
    "trainer_rank_sigstop": ("SIGSTOP trainer rank 1 of 2 (a hang)", True, r"'trainer1'.*process is stopped"),
    "trainer_rank_ctrl_c": ("SIGINT to the process group, 2 trainer ranks", True,
                            r"interrupted \(Ctrl-C or SIGTERM\) at step \d+: checkpoint"),
}


# ------------------------------------------------------------------------------ the child job
def fault_reward(tokens, meta) -> float:
    """Toy reward (fraction of ids < LOW), or the fault named in the marker file once it exists."""
    marker = os.environ.get("ASYNCRL_FAULT_MARKER", "")
    mode = Path(marker).read_text().strip() if marker and os.path.exists(marker) else ""
    if mode == "raise":
        raise RuntimeError("injected: the grader crashed")
    if mode == "nan":
        return float("nan")
    while mode == "hang":
        time.sleep(3600)
    return sum(t < LOW for t in tokens) / max(1, len(tokens))


class PacedTBA(TBA):
    """A tiny step takes ~20 ms: pace it like a real one, so the run outlasts a stall. Rank 1 of
    several raises once the marker says so."""
    def backward(self, model, batch, step):
        time.sleep(PACE_S)
        marker = os.environ.get("ASYNCRL_FAULT_MARKER", "")
        if marker and os.path.exists(marker) and Path(marker).read_text().strip() == "rank_raise":
            if dist.is_initialized() and dist.get_rank() == 1:
                raise RuntimeError("injected: trainer rank 1 crashed in backward")
        return super().backward(model, batch, step)


def make_fault_reward():
    """Reward-worker factory: the same reward, batched."""
    return lambda texts, metas: [fault_reward(t, m) for t, m in zip(texts, metas)]


def _patch_checkpoint_writes(fault: str, d: Path) -> None:
    """Make checkpoints after the first slow (so a SIGKILL lands mid-write) or fail with ENOSPC."""
    import common.runtime.files.checkpoint as ck
    orig, calls = ck.save_pretrained, [0]

    def save_pretrained(model, path, **kw):
        calls[0] += 1
        orig(model, path, **kw)
        if calls[0] < 2:
            return
        if fault == "slow":
            (d / "in_checkpoint").touch()
            time.sleep(30)
        elif fault == "enospc":
            with open(Path(path) / "trainer_state.pt", "wb") as f:
                f.write(b"\0" * 4096)  # what fit before the disk filled
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(path).parent / "trainer_state.pt"))
    ck.save_pretrained = save_pretrained


def child(a) -> None:
    import torch
    from common.contracts.batch import PromptSet
    from common.engine.machine.precision import PrecisionConfig
    from common.runtime.generator import GenConfig
    from common.runtime.train_config import TrainConfig
    from common.task import RunConfig
    from common.train import train
    from tba.algo import TBAConfig
    d = Path(a.dir)
    if a.child == "malformed_data_line":
        import run_gsm8k
        run_gsm8k.main([f"--model={a.model}", f"--data.source={d / 'data'}", f"--run_root={d / 'runs'}"])
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, even if we run in the background
    if a.checkpoint_fault:
        _patch_checkpoint_writes(a.checkpoint_fault, d)
    cfg = RunConfig(name="job", run_root=str(d / "runs"), model=a.model, precision=PrecisionConfig(dtype="fp32"),
                      gen=GenConfig(max_batch=8, max_new_tokens=8, n=4, temperature=1.0),
                      train=TrainConfig(steps=STEPS, lr=1e-3, warmup_steps=1, prompts_per_step=2, sync_every=1,
                                        min_buffer=8, buffer_capacity=16384, micro_batch_tokens=512,
                                        checkpoint_every=2, keep_checkpoints=3, stall_timeout=STALL_S,
                                        reward_workers=int(a.child == "reward_worker_sigkill"),
                                        trainer_devices=2 if a.child.startswith("trainer_rank") else 1))
    g = torch.Generator().manual_seed(0)
    prompts = PromptSet([torch.randint(LOW, 97, (4,), generator=g).tolist() for _ in range(16)])
    algo = PacedTBA(TBAConfig(beta_init=0.1, beta_final=0.1, m=0.5), 2, 4, 1.0, 512)
    train(cfg, algo, prompts, fault_reward, stop_token_ids=(), resume=a.resume,
          reward_factory=make_fault_reward if cfg.train.reward_workers else None)


# ------------------------------------------------------------------------------ the parent
def _metrics(d: Path) -> list[dict]:
    f = d / "runs" / "job" / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def _run_pids(d: Path, main: int) -> set[int] | None:
    """The job's processes (its workers.json and its main process), or None where it listed none:
    whose /dev/shm entries are the job's (bench/leaks.py)."""
    try:
        return {main, *json.loads((d / "runs" / "job" / "workers.json").read_text()).values()}
    except (OSError, ValueError):
        return None


def _start(name: str, d: Path, model: str, resume: bool, marker: Path, checkpoint_fault: str = ""):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--dir", str(d), "--model", model]
    cmd += ["--resume"] * resume + ([f"--checkpoint-fault={checkpoint_fault}"] if checkpoint_fault else [])
    log = open(d / f"{'resume' if resume else 'run'}.log", "w")
    env = {**os.environ, "ASYNCRL_FAULT_MARKER": str(marker), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), d / log.name


def inspect_checkpoints(d: Path, model: str) -> dict:
    """Load every checkpoint; check the ring rows of the latest one."""
    import torch
    from common.engine.checkpoints.hf_io import load_model
    from common.runtime.files.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
    root = d / "runs" / "job" / "checkpoints"
    ckpts = sorted(root.glob("step_*")) if root.is_dir() else []
    ok = 0
    for c in ckpts:
        m = load_model(model, tokenizer=False)[0]
        try:
            load_checkpoint(c, m, torch.optim.AdamW(m.parameters()))
            ok += 1
        except CheckpointError as e:
            print(f"[faults] {c}: {e}", file=sys.stderr)
    out = {"checkpoints": len(ckpts), "checkpoints_loadable": ok,
           "tmp_dirs_left": len(list(root.glob(".tmp_*"))) if root.is_dir() else 0}
    latest = latest_checkpoint(d / "runs" / "job")
    if latest is not None and (latest / "buffer.pt").exists():
        from common.runtime.shared.buffer import ReplayBuffer
        b = ReplayBuffer.load(latest / "buffer.pt")
        ids = b.cols["insert_idx"][b.cols["insert_idx"] >= 0].tolist()
        want = set(range(b.n_added - len(b), b.n_added))
        out.update(latest_step=json.loads((latest / "meta.json").read_text())["step"], buffer_rows=len(ids),
                   rows_lost=len(want - set(ids)), rows_duplicated=len(ids) - len(set(ids)),
                   _rows={(i, h) for i, h in zip(b.cols["insert_idx"].tolist(), b.cols["comp_hash"].tolist()) if i >= 0},
                   _counters=json.loads((latest / "meta.json").read_text())["counters"])
    return out


def run_scenario(name: str, root: Path, model: str) -> dict:
    how, stops, expect = SCENARIOS[name]
    d = root / name
    d.mkdir(parents=True)
    marker = d / "fault"
    res: dict = {"scenario": name, "fault": how}
    if name == "malformed_data_line":
        (d / "data").mkdir()
        good = json.dumps({"question": "1+1?", "answer": "two #### 2"})
        (d / "data" / "train.jsonl").write_text(f"{good}\n{good}\n{good[:20]}\n{good}\n")
        (d / "data" / "test.jsonl").write_text(f"{good}\n")
    ck_fault = {"trainer_sigkill_in_checkpoint": "slow", "disk_full_in_checkpoint": "enospc"}.get(name, "")
    shm_before = shm_entries()
    proc, log = _start(name, d, model, False, marker, ck_fault)
    t_start = time.monotonic()
    if name not in ("malformed_data_line", "disk_full_in_checkpoint"):  # those fire by themselves
        ready = (lambda: (d / "in_checkpoint").exists()) if ck_fault == "slow" else \
            (lambda: len([r for r in _metrics(d) if "step_s" in r]) >= INJECT_AT)
        if not wait_until(lambda: ready() or proc.poll() is not None, 180) or proc.poll() is not None:
            proc.kill()
            return {**res, "error": f"job ended or stalled before the fault could be injected (see {log})"}
    pids = lambda: json.loads((d / "runs" / "job" / "workers.json").read_text())  # noqa: E731
    errors_before = max([r.get("reward_errors", 0) for r in _metrics(d)] or [0])
    t_inj = time.monotonic() if name not in ("malformed_data_line", "disk_full_in_checkpoint") else t_start
    if name == "generator_sigkill":
        os.kill(pids()["generator0"], signal.SIGKILL)
    elif name == "generator_sigstop":
        os.kill(pids()["generator0"], signal.SIGSTOP)
    elif name == "reward_worker_sigkill":
        os.kill(pids()["reward0"], signal.SIGKILL)
    elif name in ("trainer_rank_sigkill", "trainer_rank_sigstop"):
        os.kill(pids()["trainer1"], signal.SIGKILL if name == "trainer_rank_sigkill" else signal.SIGSTOP)
    elif name == "trainer_sigkill_in_checkpoint":
        os.kill(proc.pid, signal.SIGKILL)
    elif name in ("ctrl_c", "trainer_rank_ctrl_c"):
        os.killpg(proc.pid, signal.SIGINT)
    elif name in ("reward_raises", "reward_hangs", "nan_reward", "trainer_rank_raises"):
        marker.write_text({"reward_raises": "raise", "reward_hangs": "hang", "nan_reward": "nan",
                           "trainer_rank_raises": "rank_raise"}[name])
    if stops:  # detected = the expected report is in the job's output; then it must exit
        said = wait_until(lambda: expect is None or re.search(expect, log.read_text(), re.S) or proc.poll() is not None, 120)
        t_det = time.monotonic()
        wait_until(lambda: proc.poll() is not None, 120)
        res["exit_s"] = round(time.monotonic() - t_inj, 2)
        detected = bool(said) and (expect is None or re.search(expect, log.read_text(), re.S) is not None)
    else:
        seen = wait_until(lambda: any(r.get("reward_errors", 0) > errors_before for r in _metrics(d)), 120, 0.05)
        t_det = time.monotonic()
        wait_until(lambda: proc.poll() is not None, 180)
        rows = [r for r in _metrics(d) if "step_s" in r]
        detected = bool(seen)
        res.update(finished_steps=rows[-1]["step"] if rows else 0, reward_errors=rows[-1]["reward_errors"] if rows else 0,
                   loss_finite=all(r.get("loss", 0) == r.get("loss", 0) for r in rows))
    if proc.poll() is None:  # never detected: stop it ourselves so the next scenario starts clean
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(1.0)  # let PDEATHSIG'd / shutting-down workers go before counting
    res.update(detected=detected, detect_s=round(t_det - t_inj, 2) if detected else None, exit_code=proc.returncode,
               processes_left=len(group_alive(proc.pid)), shm_left=sorted(leaked(shm_before, _run_pids(d, proc.pid))))
    if name == "malformed_data_line":
        res["message"] = log.read_text().strip().splitlines()[-1]  # the error the user sees
        return res
    ck = inspect_checkpoints(d, model)
    before_rows, before_counters = ck.pop("_rows", set()), ck.pop("_counters", None)
    res.update(ck)
    if stops:  # continue the run without the fault
        marker.unlink(missing_ok=True)
        proc, rlog = _start(name, d, model, True, marker)
        proc.wait(timeout=300)
        m = re.search(r"resumed from \S+ at step (\d+), version (\d+)", rlog.read_text())
        after = inspect_checkpoints(d, model)
        res.update(resume_exit_code=proc.returncode,
                   resume_same_counters=bool(m and before_counters and int(m[1]) == before_counters["step"]
                                             and int(m[2]) == before_counters["version"]),
                   resume_finished=after.get("latest_step") == STEPS,
                   resume_kept_rows=before_rows <= after.get("_rows", set()),
                   resume_rows_duplicated=after.get("rows_duplicated"))
        if "detected" in res and name == "trainer_sigkill_in_checkpoint":  # detected = the resume skipped the partial write
            res["detected"], res["detect_s"] = bool(m), None
    return res


ATTACKS = {**faults_store.ATTACKS, **faults_attacks.ATTACKS, **faults_sandbox.ATTACKS}  # name -> (the attack, the message)


def run_attack(name: str, root: Path, model: str) -> dict:
    d = root / name
    d.mkdir(parents=True)
    if name in faults_sandbox.ATTACKS:  # a program in the code sandbox: one function for every row
        return {"scenario": name, "fault": ATTACKS[name][0], **faults_sandbox.run(name, d, model)}
    module = faults_store if name in faults_store.ATTACKS else faults_attacks
    return {"scenario": name, "fault": ATTACKS[name][0], **getattr(module, name)(d, model)}


def table(rows: list[dict]) -> str:
    cols = ("scenario", "detected", "detect_s", "exit_s", "exit_code", "processes_left", "shm_left", "checkpoints_loadable",
            "rows_lost", "rows_duplicated", "resume_same_counters", "resume_kept_rows", "payload_ran", "foreign_file_kept",
            "tmp_dirs_left", "reason", "verdict_s", "connected")
    cell = lambda r, c: ("-" if r.get(c) is None else "/".join(map(str, r[c])) if c == "exit_code" and isinstance(r[c], list)  # noqa: E731
                         else str(len(r[c]) if isinstance(r[c], list) else r[c]))  # a list of codes: one per process
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(cell(r, c) if c != "checkpoints_loadable" or "checkpoints" not in r
                         else f"{r['checkpoints_loadable']}/{r['checkpoints']}" for c in cols) for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=[*SCENARIOS, *ATTACKS], help="run these scenarios only")
    ap.add_argument("--root", default=None, help="working directory (default: a temp dir)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-fault", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    root = Path(a.root or tempfile.mkdtemp(prefix="asyncrl_faults_"))
    build_tiny(root / "model", vocab_size=97, hidden_size=32, intermediate_size=64, head_dim=8)  # the toy task's ids
    rows = []
    for name in a.only or [*SCENARIOS, *ATTACKS]:
        t = time.monotonic()
        run = run_attack if name in ATTACKS else run_scenario  # the attacks and mistakes: faults_store.py, faults_attacks.py
        rows.append({**run(name, root, str(root / "model")), "scenario_s": round(time.monotonic() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows), file=sys.stderr)
    print(json.dumps({"bench": "faults", "scenarios": len(rows), "detected": sum(bool(r.get("detected")) for r in rows),
                      "processes_left": sum(r.get("processes_left", 0) for r in rows),
                      "shm_left": sum(len(r.get("shm_left", [])) for r in rows), "root": str(root)}))


if __name__ == "__main__":
    main()
