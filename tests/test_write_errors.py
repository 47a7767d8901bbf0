"""A full disk under each writer of a run: the record stream and the metrics end with one
`WriteError` line (what, the path, the cause, the free space) and leave no half-written file; and
on a real full filesystem (a small tmpfs in a private mount namespace), the checkpoint, the stream
and the metrics all fail that way while the previous checkpoint stays loadable. Checkpoints' own
simulated failures are in tests/test_checkpoint.py. A full disk is said as one wherever it shows:
an ENOSPC under another error, or torch's serializer's 'unexpected pos' on a filesystem left without
space (`common.contracts.errors.disk_full`)."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common.contracts.errors as errors
import common.runtime.files.stream as stream
from common.engine.checkpoints.hf_io import load_model
from common.contracts.errors import UserError, WriteError, disk_full, write_failed
from common.runtime.files.checkpoint import CheckpointError, save_checkpoint
from common.contracts.log import MetricsLogger, read_metrics
from common.runtime.files.stream import StreamWriter
from tests.test_checkpoint import WRITE_ERROR
from tests.tiny import save_hf

ROOT = Path(__file__).resolve().parents[1]
_ENCODED = ({"tokens": torch.arange(64)}, {"tokens": "int64"})  # what StreamWriter.capture returns


class _FillsUp:
    """A file whose writes stop half-way with ENOSPC, as on a disk that fills mid-write."""

    def __init__(self, real):
        self.real = real

    def write(self, data):
        self.real.write(bytes(data)[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.real.close()


def test_stream_write_fails_whole(tmp_path, monkeypatch):
    w = StreamWriter(tmp_path / "stream")
    w.dir.mkdir()
    w.write(1, 0, 0.1, _ENCODED, {})
    monkeypatch.setattr(stream, "open", lambda p, mode: _FillsUp(open(p, mode)), raising=False)
    with pytest.raises(WriteError) as e:
        w.write(2, 0, 0.1, _ENCODED, {})
    msg = str(e.value)
    assert re.fullmatch(WRITE_ERROR, msg) and isinstance(e.value, UserError), msg
    assert f"record stream file {w.dir / 'step_000002.safetensors'} (OSError: [Errno 28] No space left" in msg
    assert "its partial file was removed; the stream holds steps 1..1; the run stops" in msg
    assert sorted(p.name for p in w.dir.iterdir()) == ["step_000001.safetensors"]  # no .tmp_, no step 2
    assert w.steps == 1


def test_stream_fsync_failure_is_said(tmp_path, monkeypatch):
    w = StreamWriter(tmp_path / "stream")
    w.dir.mkdir()
    w.write(1, 0, 0.1, _ENCODED, {})

    def eio(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(stream.os, "fsync", eio)
    with pytest.raises(WriteError, match=r"could not write the record stream \(fsync\) .*step_000001\.safetensors "
                                         r"\(OSError: \[Errno 5\] Input/output error\); .* free on that filesystem; "
                                         r"no checkpoint was written"):
        w.sync()


def test_metrics_write_failure_stops_with_the_path(tmp_path):
    log = MetricsLogger(tmp_path)
    log.log(1, loss=1.0)
    real = log._f
    log._f = _FillsUp(real)
    with pytest.raises(WriteError) as e:
        log.log(2, loss=0.5)
    msg = str(e.value)
    assert re.fullmatch(WRITE_ERROR, msg), msg
    assert f"could not write metrics {tmp_path / 'metrics.jsonl'} (OSError: [Errno 28] No space left" in msg
    assert "the run stops: a run that cannot log loses its record" in msg
    real.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]  # the half line is skipped ...
    MetricsLogger(tmp_path).close()  # ... and cut off when the log reopens (--resume)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def _short_write():
    return RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 704 vs 598")


def test_a_full_disk_is_named_however_the_error_says_it(tmp_path, monkeypatch):
    """ENOSPC under another error (a cause, a context, DCP's per-rank failures), and torch's short
    write where the filesystem has no space left, are a full disk; the short write with room to
    spare (a quota, an I/O error) is said as it is."""
    def under(outer, inner):
        try:
            try:
                raise inner
            except OSError:
                raise outer
        except type(outer) as e:
            return e
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = under(_short_write(), enospc)
    dcp_like = RuntimeError("save failed")
    dcp_like.failures = {1: (wrapped, None)}
    assert disk_full(wrapped, tmp_path) and disk_full(dcp_like, tmp_path)
    assert not disk_full(under(RuntimeError("boom"), OSError(errno.EIO, "I/O")), tmp_path)
    monkeypatch.setattr(errors, "free_bytes", lambda path: 64 << 30)  # room to spare: not a full disk
    assert not disk_full(_short_write(), tmp_path)
    assert "(RuntimeError: [enforce fail at inline_container.cc:626] . unexpected pos 704 vs 598); 68.7 GB free" \
        in write_failed("metrics", tmp_path / "m", _short_write())
    monkeypatch.setattr(errors, "free_bytes", lambda path: 4096)  # the disk filled under the write
    assert disk_full(_short_write(), tmp_path)
    msg = write_failed("metrics", tmp_path / "m", wrapped)
    assert re.fullmatch(WRITE_ERROR, msg + "; ..."), msg
    assert "(no space left on device: RuntimeError: [enforce fail at inline_container.cc:626] . unexpected pos 704 " \
           "vs 598); 4.1 kB free on that filesystem" in msg
    said = write_failed("metrics", tmp_path / "m", enospc)  # said already: not twice
    assert "(OSError: [Errno 28] No space left on device); 4.1 kB free" in said and said.lower().count("no space") == 1


def test_a_checkpoint_on_a_full_disk_says_so_for_torchs_short_write(tmp_path, monkeypatch):
    """torch.save's zip writer on a full disk: 'unexpected pos 704 vs 598', its errno lost; the line
    names the full disk (asked before the partial copy is removed, which frees space)."""
    save_hf("llama_tied", tmp_path / "model")
    model, _ = load_model(str(tmp_path / "model"), tokenizer=False)
    opt = torch.optim.AdamW(model.parameters())
    good = save_checkpoint(tmp_path / "run", 1, model, opt)
    real_save, seen = torch.save, []

    def fills_up(obj, f, *a, **k):
        if str(f).endswith("trainer_state.pt"):
            raise _short_write()
        return real_save(obj, f, *a, **k)

    def free(path):  # nothing free while the partial copy is there, some once it is removed
        seen.append(Path(path))
        return 0 if any(".tmp_step_" in part for part in Path(path).parts) else 300_000
    monkeypatch.setattr(torch, "save", fills_up)
    monkeypatch.setattr(errors, "free_bytes", free)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path / "run", 2, model, opt)
    monkeypatch.undo()
    msg = str(e.value)
    assert re.fullmatch(WRITE_ERROR, msg), msg
    assert ("step_000002 (no space left on device: RuntimeError: [enforce fail at inline_container.cc:626] . "
            "unexpected pos 704 vs 598); 300 kB free on that filesystem; its partial copy was removed; nothing was "
            f"replaced: the previous checkpoint {good} is intact") in msg


_CHILD = r"""
import json, shutil, subprocess, sys, tempfile, torch
from pathlib import Path
from common.engine.checkpoints.hf_io import load_model
from common.contracts.errors import WriteError
from common.contracts.log import MetricsLogger
from common.runtime.files.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from common.runtime.files.stream import StreamWriter
from tests.tiny import save_hf

work = Path(sys.argv[1])
save_hf("llama_tied", work / "model")
model, _ = load_model(str(work / "model"), tokenizer=False)
opt = torch.optim.AdamW(model.parameters())
size = sum(f.stat().st_size for f in save_checkpoint(work / "probe", 1, model, opt).rglob("*") if f.is_file())
disk = work / "disk"
disk.mkdir()
# room for one checkpoint and a half: the second cannot be written
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(disk)], check=True)
out = {"size": size}
good = save_checkpoint(disk / "run", 1, model, opt)
log = MetricsLogger(disk / "run")
w = StreamWriter(disk / "run" / "stream")
w.dir.mkdir()
try:
    save_checkpoint(disk / "run", 2, model, opt)
except CheckpointError as e:
    out["checkpoint"] = str(e)
out["left"] = sorted(p.name for p in (disk / "run" / "checkpoints").iterdir())
out["loads"] = load_checkpoint(good, model, opt).step
with open(disk / "filler", "wb", buffering=0) as f:  # the rest of the space
    try:
        while True:
            f.write(b"x" * 4096)
    except OSError:
        pass
for name, write in (("stream", lambda: w.write(1, 0, 0.1, ({"t": torch.zeros(10000)}, {"t": "float32"}), {})),
                    ("metrics", lambda: log.log(1, **{f"m{i}": float(i) for i in range(2000)}))):
    try:
        write()
    except WriteError as e:
        out[name] = str(e)
out["stream_left"] = sorted(p.name for p in w.dir.iterdir())
print("RESULT " + json.dumps(out))
"""


def _namespace() -> list[str] | None:
    """A private mount namespace to mount a tmpfs in: a user namespace (no privilege needed), or
    as root a plain one; None where neither is allowed (the mount vanishes with the child)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return None
    for cmd in (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"]):
        if subprocess.run([*cmd, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", "/tmp"],
                          capture_output=True).returncode == 0:
            return cmd
    return None


@pytest.mark.skipif(sys.platform != "linux", reason="a tmpfs in a private mount namespace is Linux's")
def test_a_real_full_disk(tmp_path):
    ns = _namespace()
    if ns is None:
        pytest.skip("no mount namespace here (unshare refused): the simulated failures above stand in")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([*ns, sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(line[0][7:])
    disk = tmp_path / "disk"
    assert re.fullmatch(WRITE_ERROR, out["checkpoint"]), out
    assert re.search(rf"could not write checkpoint step 2 to {disk}/run/checkpoints/step_000002 \(.*No space left on "
                     rf"device.*\); [\d.]+ [kMGT]?B free on that filesystem; its partial copy was removed; nothing was "
                     rf"replaced: the previous checkpoint {disk}/run/checkpoints/step_000001 is intact",
                     out["checkpoint"])
    assert out["left"] == ["step_000001"] and out["loads"] == 1
    assert re.search(r"warning: checkpoint step 2 needs about .* it will likely fail", r.stderr), r.stderr[-2000:]
    for name in ("stream", "metrics"):
        assert re.fullmatch(WRITE_ERROR, out[name]) and "No space left on device" in out[name], out
    assert out["stream_left"] == []  # no half-written step file left as if valid
