"""Replay a recorded run's trajectory stream under an algorithm and config of your choice:
the library call `replay(...)` and the command line. Runs in the launching process, with no
generators (the loop is `common/runtime/replay.py`; the stream format `common/runtime/stream.py`).

    python run_gsm8k.py --train.record=true --name=x            # record (any task, any algorithm)
    python -m common.replay runs/x/stream --name=x_tb           # the same algorithm and config: same weights
    python -m common.replay runs/x/stream --name=x_noref --tba.beta_final=0.01 --train.lr=2e-5
    python -m common.replay runs/x/stream --algo=grpo --name=x_grpo   # another loss on the same data

The config starts as the recording's (train, gen, tba, grpo, areal, log, precision sections;
a task's own sections such as data are not needed) and takes `--section.field=value`
overrides like a task script; `train.steps` caps the steps replayed (default: all recorded).
Each replay writes runs/<name>/ like a training run, and `<recorded run>/replays.png` lays the
recorded run and every replay of its stream under the same run_root side by side.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional, Union

from common.algorithm import Algorithm
from common.config import ConfigError, format_help, load_config, parse_overrides
from common.engine.precision import Precision, resolve
from common.log import plot_metrics
from common.runtime.replay import plot_replays, replay_stream
from common.runtime.stream import StreamError, read_meta, stream_steps
from common.task import RunConfig, make_algo, setup


def stream_dir(path) -> Path:
    """A stream directory, given it or the run directory that holds it."""
    p = Path(path)
    return p / "stream" if not (p / "stream.json").is_file() and (p / "stream" / "stream.json").is_file() else p


def replay_config(stream, argv=(), name: Optional[str] = None) -> RunConfig:
    """The recording's run config (its shared sections), then `argv` overrides; the name defaults
    to `<recorded name>_replay_<algo>`. Its precision is the recording's resolved one unless overridden."""
    stream = stream_dir(stream)
    meta = read_meta(stream)
    shared = {f for f in RunConfig.__dataclass_fields__}
    rec = {k: v for k, v in meta["config"].items() if k in shared}
    rec.update(resume=False)
    cfg = load_config(RunConfig, rec)
    args = list(argv)
    cfg = parse_overrides(cfg, args)
    if name is not None:
        cfg.name = name
    elif not any(a.startswith("--name") for a in args):
        cfg.name = f"{meta['run']}_replay_{cfg.algo}"
    cfg.train.steps = min(cfg.train.steps, len(stream_steps(stream)))
    return cfg


def replay(stream, algo: Union[None, str, Algorithm, Callable[[RunConfig], Algorithm]] = None,
           argv=(), cfg: Optional[RunConfig] = None, evaluate: Optional[Callable] = None,
           name: Optional[str] = None, loss: Optional[Callable] = None, overwrite: bool = False) -> dict:
    """Train from the recorded run's initial weights on exactly its recorded batches, no
    generators; returns the last logged metrics. `stream`: a stream or run directory. `algo`:
    None (the config's), a name ("tba", "areal", "grpo"), an `Algorithm`, or a function of the
    config that builds one (e.g. `lambda cfg: TBA(cfg.tba, ..., loss_fn=my_loss)`). `loss`: a loss
    function for the config's (or `algo`'s named) algorithm, as `task.run(..., loss=)` takes it.
    `cfg` defaults to `replay_config(stream, argv, name)`; `overwrite` replaces an earlier replay
    of that name. evaluate(model, tokenizer) -> {metric: value} is called before, every
    train.eval_every steps and after, as in training."""
    stream = stream_dir(stream)
    meta = read_meta(stream)
    if cfg is None:
        if isinstance(algo, str):
            argv = [f"--algo={algo}", *argv]
        cfg = replay_config(stream, argv, name)
    cfg.overwrite = cfg.overwrite or overwrite
    if algo is None or isinstance(algo, str):
        algo = make_algo(cfg, loss)
    elif loss is not None:
        raise ValueError("replay: pass a loss with algo=None or an algorithm's name, not with an Algorithm")
    elif not isinstance(algo, Algorithm):
        algo = algo(cfg)
    rec_prec = load_config(RunConfig, {"precision": meta["config"]["precision"]}).precision
    precision = Precision.from_dict(meta["precision"]) if cfg.precision == rec_prec else None
    if precision is None:  # asked for another precision: resolve it here
        precision = resolve(cfg.precision, cfg.train.device)
    last = replay_stream(cfg, algo, stream, precision=precision, evaluate=evaluate, steps=cfg.train.steps)
    run_dir = Path(cfg.run_root) / cfg.name
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png", title=f"{cfg.name}: replay of {meta['run']}")
    if plot_replays(replays_of(stream, cfg.run_root), stream.parent / "replays.png",
                    title=f"replays of {meta['run']}'s stream") is not None:
        print(f"[asyncrl] replays side by side: {stream.parent / 'replays.png'}")
    return last


def replays_of(stream, run_root) -> list[tuple[Path, str]]:
    """(run dir, label) of the recorded run and every replay of `stream` under run_root."""
    stream = Path(stream).resolve()
    runs = [(stream.parent, f"{stream.parent.name} (recorded)")]
    for f in sorted(Path(run_root).glob("*/replay_of.json")):
        try:
            if Path(json.loads(f.read_text())["stream"]) == stream and (f.parent / "metrics.jsonl").is_file():
                runs.append((f.parent, f.parent.name))
        except (OSError, ValueError, KeyError):
            continue
    return [(d, label) for d, label in runs if (d / "metrics.jsonl").is_file()]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        stream = stream_dir(argv[0])
        if "-h" in argv or "--help" in argv:
            print(format_help(replay_config(stream), __doc__))
            return 0
        cfg = replay_config(stream, argv[1:])
    except (StreamError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup(cfg)
    replay(stream, cfg=cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
