"""Metrics JSONL round trip, resume, crash fragments (common/contracts/log.py), plots (common/contracts/plots.py) and the
progress bars (common/contracts/progress.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import common.contracts.progress as progress_mod
from common.contracts.log import MetricsLogger, read_metrics
from common.contracts.plots import plot_metrics, plot_runs
from common.contracts.progress import Progress, SampleBar


def _fake_run(path, n=20, t_scale=30.0, offset=0.0):
    """reward on every line, eval accuracy every 5 lines, time in seconds."""
    with open(path, "w") as f:
        for i in range(n):
            rec = {"step": i, "time": i * t_scale, "reward_mean": offset + 0.02 * i}
            if i % 5 == 0:
                rec["eval_accuracy"] = offset + 0.01 * i
            f.write(json.dumps(rec) + "\n")
    return path


def _is_png(p):
    return p is not None and p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_read_round_trip(tmp_path):
    with MetricsLogger(tmp_path) as lg:
        lg.log(1, loss=torch.tensor(0.5), reward_mean=np.float32(0.25), n=np.int64(3), ok=True,
               staleness_hist={0: 5, 2: torch.tensor(1)}, lens=torch.tensor([1.0, 2.0]), tag="x")
        lg.log(2, loss=0.125)
        with pytest.raises(ValueError, match="reserved"):
            lg.log(3, time=1.0)
        with pytest.raises(TypeError, match="'bad'"):
            lg.log(3, bad=object())
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    r = recs[0]
    assert r["loss"] == 0.5 and type(r["loss"]) is float and r["reward_mean"] == 0.25
    assert r["n"] == 3.0 and r["ok"] is True and r["tag"] == "x" and r["lens"] == [1.0, 2.0]
    assert r["staleness_hist"] == {"0": 5, "2": 1.0}
    assert 0 <= r["time"] <= recs[1]["time"]


def test_resume_continues_time_and_drops_fragment(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"step": 1, "time": 100.0, "loss": 1.0}) + "\n" + '{"step": 2, "ti')
    assert [r["step"] for r in read_metrics(f)] == [1]  # truncated last line skipped
    with MetricsLogger(tmp_path) as lg:
        lg.log(2, loss=0.5)
    recs = read_metrics(f)
    assert [r["step"] for r in recs] == [1, 2]  # fragment cut, not glued to the new record
    assert 100.0 <= recs[1]["time"] < 110.0


def test_resume_discards_rows_after_the_checkpoint_step(tmp_path):
    """A run that died after its checkpoint at step 2 had logged steps 3 and 4: resuming from 2
    moves them aside, so the continued run's step 3 is the only step-3 row."""
    lg = MetricsLogger(tmp_path)
    for s in range(5):
        lg.log(s, loss=float(s))
    lg.close()
    lg = MetricsLogger(tmp_path, keep_to=2)
    lg.log(3, loss=30.0)
    lg.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(0, 0.0), (1, 1.0), (2, 2.0),
                                                                                          (3, 30.0)]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics_discarded.jsonl")] == [3, 4]
    times = [r["time"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert times == sorted(times)


def test_corrupt_middle_line_is_an_error(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2"):
        read_metrics(f)


def test_missing_optional_backends_warn_once(tmp_path, capsys, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_extras(name, *a, **k):
        if name in ("wandb", "torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_extras)
    lg = MetricsLogger(tmp_path, use_tensorboard=True, use_wandb=True, wandb_project="p")
    lg.log(0, loss=1.0)
    lg.close()
    err = capsys.readouterr().err
    assert err.count("tensorboard is not installed") == 1 and err.count("wandb is not installed") == 1


def test_plot_single_run(tmp_path):
    m = _fake_run(tmp_path / "metrics.jsonl")
    out = plot_metrics(m, tmp_path / "plots" / "run.png", title="tiny")
    assert _is_png(out)
    assert _is_png(plot_metrics(m, tmp_path / "by_step.png", x="step"))


def test_plot_overlay_and_missing_panels(tmp_path):
    a = _fake_run(tmp_path / "sync.jsonl", t_scale=60.0)
    b = _fake_run(tmp_path / "async.jsonl", t_scale=20.0, offset=0.1)
    fig = plot_runs([(a, "sync"), (b, "async")], tmp_path / "cmp.png")
    assert _is_png(tmp_path / "cmp.png")
    # a Figure to show in a notebook, one colour per run in every panel
    colours = [{line.get_label(): line.get_color() for line in ax.get_lines()} for ax in fig.axes]
    assert len(colours) >= 2 and all(c == colours[0] for c in colours) and len(set(colours[0].values())) == 2
    panels = (("reward_mean", "reward"), ("kl", "KL (never logged)"))
    assert _is_png(plot_metrics([(a, "sync"), (b, "async")], tmp_path / "cmp2.png", panels=panels))
    assert plot_metrics(a, tmp_path / "none.png", panels=(("kl", "KL"),)) is None
    assert not (tmp_path / "none.png").exists()


def test_plot_runs_takes_run_dirs_and_writes_no_file_unless_asked(tmp_path):
    for name in ("tb", "tb_no_ref"):
        (tmp_path / name).mkdir()
        _fake_run(tmp_path / name / "metrics.jsonl")
    fig = plot_runs([tmp_path / "tb", tmp_path / "tb_no_ref"], x="step")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["tb", "tb_no_ref"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tb", "tb_no_ref"]  # no PNG written
    # what a Jupyter kernel displays (no pyplot, so no inline backend knows this figure): a PNG
    png = fig._repr_png_()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_fmt_and_progress(capsys):
    assert [progress_mod._fmt(v) for v in (0.41, 1.2e-3, 120.0, 7, torch.tensor(0.5), 0.0)] == \
        ["0.41", "1.2e-3", "120", "7", "0.5", "0"]
    with Progress(total=3, initial=1, desc="train") as p:
        p.update(1, reward=0.41, loss=1.2e-3, **{"tok/s": 120.0})
        p.update()
        assert p._bar.n == 3 and "reward=0.41 loss=1.2e-3 tok/s=120" in p._bar.postfix


def test_a_sampling_bar_gives_an_eta_only_from_a_real_rate():
    """A first wave of rows finishes together: 2 of 300 samples done after 60 s would make tqdm say
    2:29:00 left where the run ends in about 3 minutes. No ETA until a wave's worth (100) has
    finished, then the mean rate since the start; where all run at once, none ever."""
    clock = [0.0]
    bar = SampleBar(300, concurrent=100, desc="eval")
    bar._bar._time = lambda: clock[0]
    bar._bar.start_t = 0.0
    clock[0] = 60.0
    bar.update(2)
    shown = str(bar._bar)
    assert "2/300 [01:00]" in shown and "<" not in shown and "/s" not in shown  # no made-up 2:29:00
    clock[0] = 90.0
    bar.update(98)  # the first wave done: 100 in 90 s, 200 left
    assert "100/300 [01:30<03:00," in str(bar._bar)
    bar.close()
    one_wave = SampleBar(64, concurrent=128)
    one_wave.update(63)
    assert "<" not in str(one_wave._bar) and "63/64" in str(one_wave._bar)
    one_wave.close()
