"""The generator's loop (common/runtime/generator.py: generator_main), run in this process with a
control that moves under it exactly where a real trainer can: a prompt is sampled with the
weights of the version whose quota admitted it."""
import multiprocessing as mp

import pytest
import torch

from common.batch import PromptSet
from common.engine.hf_io import load_model
from common.engine.precision import Precision
from common.runtime.buffer import ReplayBuffer
from common.runtime.generator import Control, GenConfig, decode_graphs, decode_overlap, generator_main, prompt_order
from common.runtime.watchdog import Heartbeats
from common.runtime.weights import WeightStore
from tests.tiny import save_hf

B = 3  # prompts per version


class RacingControl(Control):
    """Sync admission (eta = 0), as a sync trainer moves it: once version 0's B groups are all in,
    it publishes version 1, then raises the quota, here right after the generator last read the
    store's version and before its next claim: the widest form of the race between the loop's
    version check and its claim (a claim on another node's store is a network round trip)."""

    def __init__(self, store: WeightStore, v1_state: dict, buffer: ReplayBuffer, n: int):
        super().__init__(mp.get_context("spawn"), B, 0, 1)
        self.store, self.v1_state, self.buffer, self.n = store, v1_state, buffer, n

    def claim(self):
        if self.buffer.n_added == B * self.n and self.store.version == 0:
            self.store.publish(self.v1_state, 1)  # the trainer: weights first ...
            self.set_version(1)  # ... then the quota
        return super().claim()


class Until:
    """stop_event: set once the buffer holds `groups` groups (the loop asks every iteration)."""

    def __init__(self, buffer: ReplayBuffer, groups: int):
        self.buffer, self.groups = buffer, groups

    def is_set(self) -> bool:
        return self.buffer.n_added >= self.groups * 2


@pytest.mark.parametrize("mode,overlap", [("finish", False), ("interrupt", False), ("finish", True), ("interrupt", True)])
def test_a_prompt_is_sampled_with_the_version_that_admitted_it(tmp_path, mode, overlap):
    save_hf("llama_tied", tmp_path / "model")
    model = load_model(str(tmp_path / "model"), tokenizer=False)[0]
    store = WeightStore.from_module(model)
    store.publish(model, 0)
    v1 = {k: v + 0.01 for k, v in model.state_dict().items()}  # any other weights
    buffer = ReplayBuffer(64, 16)
    control = RacingControl(store, v1, buffer, n=2)
    prompts = PromptSet([[5 + i, 6 + i, 7 + i] for i in range(2 * B)])
    cfg = GenConfig(max_batch=4, max_new_tokens=4, n=2, temperature=1.0, update_mode=mode, queue_depth=2,
                    overlap=overlap)
    generator_main(0, cfg, str(tmp_path / "model"), None, store, buffer, control, prompts, lambda t, m: 0.0, 0, 16,
                   (), "cpu", Precision("fp32", "aten", "fp32"), stop_event=Until(buffer, 2 * B),
                   beat=Heartbeats(["g"], tmp_path / "stacks").beat_for("g"))
    assert int(control.t[Control.STARTED]) == 2 * B
    got = buffer.get(list(range(buffer.n_added)))
    v0_prompts = {prompt_order(0, len(prompts.tokens), i) for i in range(B)}  # claims 0..B-1, in dataset indices
    first = [set(v[m].tolist()) for v, m, g in zip(got.versions, got.loss_mask, got.group_id.tolist()) if g in v0_prompts]
    last = [set(v[m].tolist()) for v, m, g in zip(got.versions, got.loss_mask, got.group_id.tolist())
            if g not in v0_prompts]
    assert len(first) == len(last) == 2 * B  # n = 2 samples of B prompts each
    assert all(v == {0} for v in first)  # admitted under version 0: sampled with it
    assert all(v == {1} for v in last), last  # admitted under version 1: every token from it


def test_decode_graphs_default_on_cuda_only_and_an_explicit_choice_wins():
    assert GenConfig().cuda_graphs is None
    assert decode_graphs(GenConfig(), "cuda") and decode_graphs(GenConfig(), torch.device("cuda", 1))
    assert not decode_graphs(GenConfig(), "cpu")
    assert not decode_graphs(GenConfig(cuda_graphs=False), "cuda")
    assert decode_graphs(GenConfig(cuda_graphs=True), "cpu")  # asked for: the trainer refuses it on CPU


def test_decode_overlap_default_follows_the_cuda_graphs_and_an_explicit_choice_wins():
    assert GenConfig().overlap is None
    assert decode_overlap(GenConfig(), "cuda") and not decode_overlap(GenConfig(), "cpu")
    assert not decode_overlap(GenConfig(cuda_graphs=False), "cuda")  # nothing captured: nothing launched ahead
    assert not decode_overlap(GenConfig(overlap=False), "cuda")
    assert decode_overlap(GenConfig(overlap=True), "cpu")  # the CPU path runs it too (its tests do)
