"""`python bench/staleness.py --preset areal_eta` (AReaL's staleness ablation at its own setup) runs
end to end on the CPU with the preset scaled to a tiny model: one run per (loss, eta), eta 0 in
lock-step once, naive PPO through `main(loss=)`; each run trains its steps at its bound."""
import argparse

import pytest

from bench.staleness import preset_sweep

SMALL = ["model=tiny", "train.device=cpu", "train.n_generators=1", "train.memory_fraction=0", "gen.memory_fraction=0",
         "train.activation_checkpointing=false", "train.prompts_per_step=2", "gen.n=2", "gen.max_new_tokens=8",
         "gen.max_batch=8", "train.min_buffer=4", "train.buffer_capacity=64", "train.steps=2",
         "train.micro_batch_tokens=2048", "data.eval_size=0", "train.checkpoint_every=0", "precision.dtype=fp32"]


@pytest.mark.slow  # the suite's time: 30 s of the bench's preset path; bench/staleness.py's own runs are in test_staleness*
def test_the_areal_eta_preset_sweeps_eta_and_the_loss(tmp_path):
    a = argparse.Namespace(preset="areal_eta", etas=[0, 1], random_weights=False, set=SMALL, root=str(tmp_path))
    out = preset_sweep(a)
    assert [(r["loss"], r["eta"]) for r in out["runs"]] == [("decoupled", 0), ("decoupled", 1), ("naive", 1)]
    for r in out["runs"]:
        assert r["steps"] == 2 and r["version"] == 2 and r["staleness_mean"] <= r["eta"]
    assert (tmp_path / "areal_eta_naive_eta1" / "config.json").read_text().count('"max_staleness": 1') == 1
