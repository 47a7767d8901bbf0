"""A one-device run is the core alone: following `cfg` from the entry (`common.train.train`) through
a whole run on one device (evaluation, checkpoints, the stream, then a resume) enters no function of
the rank layer (common/runtime/ranks/) or the node layer (common/runtime/nodes/) in the trainer's
process, any thread of it. Measured with a profile hook on every Python call; the modules of ours
it does enter are printed (pytest -s)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import common
from common.train import train
from tests.test_e2e import _cfg, _prompts, _tba, toy_reward

REPO = Path(common.__file__).resolve().parents[1]
LAYERS = ("common/runtime/ranks/", "common/runtime/nodes/")


def _entered(run) -> list[str]:
    """Our files (repo-relative) whose functions `run()` calls, in the order first entered."""
    seen: dict[str, None] = {}
    ours = str(REPO / "common")

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ours):
            seen.setdefault(frame.f_code.co_filename)
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return [str(Path(f).relative_to(REPO)) for f in seen]


def test_one_device_run_enters_no_rank_or_node_module(tmp_path):
    cfg = _cfg(tmp_path, steps=4, checkpoint_every=2, eval_every=2, record=True)

    def evaluate(model, tokenizer):
        return {"eval_x": 0.0}

    def run():
        train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=(), evaluate=evaluate)
        cfg.train.steps = 6
        train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=(), evaluate=evaluate, resume=True)
    files = _entered(run)
    print(f"\n{len(files)} of our modules entered on one device:\n  " + "\n  ".join(files))
    assert [f for f in files if f.startswith(LAYERS)] == []
    assert {"common/train.py", "common/runtime/trainer.py", "common/runtime/step.py", "common/runtime/peers.py",
            "common/runtime/files/checkpoint.py", "common/runtime/files/state.py", "common/runtime/files/stream.py"} <= set(files)


def test_the_hook_sees_the_rank_layer_when_it_runs(tmp_path):
    """The measurement itself: a run with two trainer ranks does enter common/runtime/ranks/."""
    cfg = _cfg(tmp_path, steps=2, trainer_devices=2)
    files = _entered(lambda: train(cfg, _tba(cfg), _prompts(), toy_reward, stop_token_ids=()))
    assert "common/runtime/ranks/group.py" in files and not [f for f in files if f.startswith(LAYERS[1])]
