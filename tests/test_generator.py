"""The generator's loop (common/runtime/generator.py: generator_main), run in this process with a
control that moves under it exactly where a real trainer can: a prompt is sampled with the
weights of the version whose quota admitted it."""
import multiprocessing as mp
import threading

import pytest
import torch

from areal.algo import AReaL, AReaLConfig
from common.contracts.batch import PromptSet, Trajectory
from common.engine.checkpoints.hf_io import load_model
from common.engine.machine.precision import Precision
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.generator import Control, GenConfig, decode_graphs, decode_overlap, generator_main, prompt_order
from common.runtime.run_log import staleness
from common.runtime.watchdog import Heartbeats
from common.runtime.shared.weights import WeightStore
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


def _group(g: int, version: int, n: int):
    return [Trajectory(prompt=torch.tensor([3, 4]), completion=torch.tensor([5, 6]), logp=torch.tensor([-1.0, -1.0]),
                       versions=torch.tensor([version, version]), reward=float(i), group_id=g) for i in range(n)]


def test_groups_the_filter_drops_give_their_places_back_so_admission_never_stalls():
    """Every third group runs long (finishes four ticks after it starts, its tokens from its start
    version) and is dropped as too stale by AReaL's filter. Its prompt was counted as started:
    without giving its place back, every such drop narrows the window for good, and after
    eta x P of them the generators can never start a batch's worth of prompts again: the run
    waits forever. With the places given back (`set_version(dropped=)`), training goes on, and the
    bound holds (the quota counts trained prompts, not dropped ones)."""
    P, n, eta = 2, 2, 1
    c, buf = Control(threading, P, eta), ReplayBuffer(64, 16, pad_id=0)
    algo = AReaL(AReaLConfig(), P, n, 1.0, 256, max_staleness=eta)
    version, running = 0, []  # (finish tick, group, start version)
    for tick in range(40):
        for s in iter(c.claim, None):
            running.append((tick + (4 if s % 3 == 0 else 0), s, version))
        for done in [r for r in running if r[0] <= tick]:
            buf.add(_group(done[1], done[2], n))
            running.remove(done)
        batch = algo.next_batch(buf, step=version, version=version, sync=False)
        if batch is not None:
            assert max(staleness(batch, version)[0]) <= eta
            version += 1
        c.set_version(version, dropped=buf.n_dropped_stale // n)
    # 40 ticks, a version per tick at best: without the places back it stops for good at version 12
    # (after eta x P = 2 dropped groups); with them it reaches 21, having dropped 17 groups
    assert version >= 16, version
    assert buf.n_dropped_stale >= 8 * n


class RepeatingControl(Control):
    """A claim counter written back on the store (a replay) hands out each index twice in a row."""

    def __init__(self, n_claims: int):
        super().__init__(mp.get_context("spawn"), n_claims, None, 1)
        self.given = []

    def claim(self):
        if len(self.given) >= 2 * self.prompts_per_version:
            return None
        self.given.append(len(self.given) // 2)  # 0, 0, 1, 1, ...
        return self.given[-1]


def test_a_repeated_claim_is_sampled_once_and_the_generator_goes_on(tmp_path, caplog):
    save_hf("llama_tied", tmp_path / "model")
    model = load_model(str(tmp_path / "model"), tokenizer=False)[0]
    store = WeightStore.from_module(model)
    store.publish(model, 0)
    buffer, control = ReplayBuffer(64, 16), RepeatingControl(4)
    prompts = PromptSet([[5 + i, 6 + i, 7 + i] for i in range(4)])
    cfg = GenConfig(max_batch=4, max_new_tokens=4, n=2, temperature=1.0, queue_depth=4)
    generator_main(0, cfg, str(tmp_path / "model"), None, store, buffer, control, prompts, lambda t, m: 0.0, 0, 16,
                   (), "cpu", Precision("fp32", "aten", "fp32"), stop_event=Until(buffer, 4),
                   beat=Heartbeats(["g"], tmp_path / "stacks").beat_for("g"))
    got = buffer.get(list(range(buffer.n_added)))
    assert sorted(got.group_id.tolist()) == sorted(2 * [prompt_order(0, 4, i) for i in range(4)])  # each prompt's n once
    assert "already in flight here; dropped the repeat" in caplog.text
