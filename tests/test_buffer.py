"""Tests for common/runtime/shared/buffer.py and common/runtime/shared/buffer_sampling.py (shared-memory ring replay buffer)."""
import math
import random
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from common.contracts.batch import Trajectory, collate
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.shared.buffer_sampling import sample_tba, take_oldest

torch.set_num_threads(1)


def traj(prompt, completion, reward=0.0, group_id=0, version=0, logp=None, finish="stop", ref=math.nan):
    c = torch.tensor(completion, dtype=torch.long)
    return Trajectory(prompt=torch.tensor(prompt, dtype=torch.long), completion=c,
                      logp=-0.1 * torch.arange(1, len(c) + 1, dtype=torch.float32) if logp is None else logp,
                      versions=torch.full((len(c),), version, dtype=torch.long),
                      reward=reward, group_id=group_id, finish_reason=finish, ref_seq_logp=ref)


def random_trajs(n, seed=0, max_len=12):
    g = random.Random(seed)
    out = []
    for i in range(n):
        p, c = g.randint(1, 5), g.randint(0, max_len - 5)
        out.append(traj([g.randint(1, 50) for _ in range(p)], [g.randint(1, 50) for _ in range(c)],
                        reward=g.random(), group_id=g.randint(0, 3), version=g.randint(0, 4),
                        finish=g.choice(["stop", "length"]), ref=g.choice([math.nan, -g.random()])))
    return out


def assert_batch_equal(a, b):
    for k in ("tokens", "loss_mask", "behav_logp", "versions", "reward", "group_id", "prompt_lens",
              "comp_lens", "ref_seq_logp"):
        x, y = getattr(a, k), getattr(b, k)
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x, y) if not x.is_floating_point() else torch.allclose(x, y, equal_nan=True), k
    assert a.extra.keys() == b.extra.keys() == {"finish"} and torch.equal(a.extra["finish"], b.extra["finish"])


# ------------------------------------------------------------------ round trip, ring
def test_round_trip_matches_collate():
    trajs = random_trajs(7)
    buf = ReplayBuffer(capacity=10, max_seq_len=12, pad_id=0)
    buf.add(trajs[:3], trainer_version=1)
    buf.add(trajs[3:], trainer_version=2)
    assert len(buf) == 7 and buf.n_added == 7 and buf.capacity == 10
    assert_batch_equal(buf.get(range(7)), collate(trajs, pad_id=0))
    rows = [5, 0, 3]  # a subset is trimmed to its own longest row, like collate
    assert_batch_equal(buf.get(rows), collate([trajs[r] for r in rows]))
    empty_completion = traj([4, 5], [])
    buf.add([empty_completion])
    assert_batch_equal(buf.get([7]), collate([empty_completion]))
    with pytest.raises(ValueError, match="empty"):
        buf.get([9])  # never written


def test_wrap_around_overwrites_oldest():
    trajs = random_trajs(9, seed=1)
    buf = ReplayBuffer(capacity=4, max_seq_len=12, pad_id=7)
    for t in trajs:
        buf.add([t])
    assert len(buf) == 4 and buf.n_added == 9
    meta = buf.snapshot_meta()
    assert sorted(meta.insert_idx.tolist()) == [5, 6, 7, 8]
    order = np.argsort(meta.insert_idx)
    assert_batch_equal(buf.get(meta.rows[order].tolist()), collate(trajs[5:], pad_id=7))
    buf.add(trajs[:6])  # one add larger than the ring: only its last 4 survive
    assert buf.n_added == 15
    meta = buf.snapshot_meta()
    order = np.argsort(meta.insert_idx)
    assert_batch_equal(buf.get(meta.rows[order].tolist()), collate(trajs[2:6], pad_id=7))


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("bad,field", [
    (traj([1] * 6, [2] * 8), "prompt\\+completion length 14 > max_seq_len 12"),
    (traj([1], [2], reward=math.nan), "reward"),
    (traj([1], [2], reward=math.inf), "reward"),
    (traj([1], [2, 3], logp=torch.tensor([0.0, math.nan])), "logp"),
    (traj([], [2, 3]), "empty prompt"),
])
def test_bad_data_rejected_atomically(bad, field):
    buf = ReplayBuffer(capacity=4, max_seq_len=12)
    good = random_trajs(3, seed=2)
    buf.add(good)
    before = {k: v.clone() for k, v in buf.cols.items()}
    with pytest.raises(ValueError, match=field):
        buf.add([traj([9], [9, 9]), bad], trainer_version=5)  # the good one must not land either
    assert buf.n_added == 3 and len(buf) == 3
    for k, v in buf.cols.items():
        assert torch.equal(v, before[k]) or (v.is_floating_point() and torch.allclose(v, before[k], equal_nan=True)), k


# ------------------------------------------------------------------ concurrency
def consistent_traj(v):
    """Every field derives from v, so a row mixing two trajectories (torn) is detectable."""
    p, c = 1 + v % 5, 1 + v % 20
    return Trajectory(prompt=torch.full((p,), v), completion=torch.full((c,), v),
                      logp=torch.full((c,), -float(v)), versions=torch.full((c,), v),
                      reward=float(v), group_id=v)


def _writer(buf, wid, n, chunk):
    torch.set_num_threads(1)
    for s in range(0, n, chunk):
        buf.add([consistent_traj(wid * 10_000 + i + 1) for i in range(s, min(s + chunk, n))], trainer_version=wid)
        time.sleep(0.001)  # spread writes out so they interleave with the reader


def check_consistent(b):
    for i in range(len(b)):
        v = int(b.reward[i])
        p, c = int(b.prompt_lens[i]), int(b.comp_lens[i])
        assert (p, c) == (1 + v % 5, 1 + v % 20) and int(b.group_id[i]) == v
        assert (b.tokens[i, :p + c] == v).all() and (b.tokens[i, p + c:] == 0).all()
        assert (b.behav_logp[i, p:p + c] == -v).all() and (b.versions[i, p:p + c] == v).all()


def test_concurrent_writers_no_torn_rows():
    ctx = mp.get_context("spawn")
    buf = ReplayBuffer(capacity=64, max_seq_len=32)
    n_each, n_writers = 300, 3
    procs = [ctx.Process(target=_writer, args=(buf, w, n_each, 5)) for w in range(n_writers)]
    for p in procs:
        p.start()
    rng, reads_mid_write, deadline = random.Random(0), 0, time.time() + 45
    while any(p.is_alive() for p in procs) and time.time() < deadline:
        n = len(buf)
        if n == 0:
            time.sleep(0.001)
            continue
        check_consistent(buf.get(rng.sample(range(n), min(8, n))))
        meta = buf.snapshot_meta()
        assert (meta.group_id == meta.reward.astype(np.int64)).all()
        reads_mid_write += 0 < meta.n_added < n_writers * n_each
    for p in procs:
        p.join(timeout=15)
        if p.is_alive():
            p.kill()
        assert p.exitcode == 0
    assert reads_mid_write > 0, "reader never overlapped the writers"
    assert buf.n_added == n_writers * n_each and len(buf) == 64
    check_consistent(buf.get(range(64)))
    assert sorted(buf.snapshot_meta().insert_idx.tolist()) == list(range(900 - 64, 900))


# ------------------------------------------------------------------ TBA sampling
def filled(groups, capacity=256):
    """groups: list of (group_id, completion, reward, trainer_version), added in order."""
    buf = ReplayBuffer(capacity=capacity, max_seq_len=16)
    for g, comp, r, tv in groups:
        buf.add([traj([1, 2], comp, reward=r, group_id=g, version=tv)], trainer_version=tv)
    return buf


def test_tba_m1_takes_newest_recent_rows_contiguously():
    rows = [(g, [g, i], 0.0, 0) for g in range(5) for i in range(3)]      # rows 0..14, old round
    rows += [(g, [g, 10 + i], 0.0, 2) for g in (1, 3) for i in range(4)]  # rows 15..22, latest round
    buf, gen = filled(rows), torch.Generator().manual_seed(0)
    meta = buf.snapshot_meta()
    out = sample_tba(meta, n_groups=6, k=2, m=1.0, latest_version=2, generator=gen)
    assert len(out) == 12
    for s in range(6):
        slot = out[2 * s:2 * s + 2]
        g = int(meta.group_id[slot[0]])
        newest = {15 + 2, 15 + 3} if g == 1 else {19 + 2, 19 + 3}
        assert g in (1, 3) and set(slot) == newest
    # no row at latest_version: falls back to the any-group rule
    out = sample_tba(meta, n_groups=5, k=2, m=1.0, latest_version=99, generator=gen)
    assert sorted(int(meta.group_id[out[2 * s]]) for s in range(5)) == [0, 1, 2, 3, 4]  # cycling
    for s in range(5):
        assert len({int(meta.group_id[r]) for r in out[2 * s:2 * s + 2]}) == 1  # contiguous groups


def test_tba_reward_mode_prefers_high_reward():
    buf = filled([(0, [i + 1], r, 0) for i, r in enumerate([0.0, 0.1, 1.0, 0.2])])
    meta, gen = buf.snapshot_meta(), torch.Generator().manual_seed(1)
    out = sample_tba(meta, n_groups=400, k=1, m=0.0, latest_version=0, mode="reward", inv_temp=50.0, generator=gen)
    assert np.mean(np.array(out) == 2) > 0.95
    out = sample_tba(meta, n_groups=400, k=1, m=0.0, latest_version=0, mode="uniform", generator=gen)
    assert 0.15 < np.mean(np.array(out) == 2) < 0.35


def test_tba_dedup_replacement_and_max_per_group():
    buf = filled([(0, [7, 7], 0.0, 0)] * 5 + [(0, [8], 0.0, 0)])  # 5 copies of A, one B
    meta, gen = buf.snapshot_meta(), torch.Generator().manual_seed(2)
    out = np.array(sample_tba(meta, n_groups=2000, k=1, m=0.0, latest_version=0, generator=gen))
    assert set(out.tolist()) <= {4, 5}  # only the newest copy of A survives de-duplication
    assert 0.45 < np.mean(out == 4) < 0.55
    out = sample_tba(meta, n_groups=1, k=5, m=0.0, latest_version=0, generator=gen)
    assert len(out) == 5 and set(out) <= {4, 5}  # fewer than k distinct: with replacement
    out = sample_tba(meta, n_groups=1, k=5, m=1.0, latest_version=0, generator=gen)
    assert out[:2] == [5, 4] and set(out) <= {4, 5}  # recent: newest first, then refill
    buf = filled([(3, [i + 1], 0.0, 0) for i in range(10)])
    out = sample_tba(buf.snapshot_meta(), n_groups=50, k=3, m=0.0, latest_version=0, generator=gen, max_per_group=3)
    assert set(out) == {7, 8, 9}


def test_tba_buffer_method_returns_batch():
    buf = filled([(g, [g + 1, i + 1], float(i), 1) for g in range(3) for i in range(4)])
    b = buf.sample_tba_batch(n_groups=3, k=4, m=0.5, latest_version=1, generator=torch.Generator().manual_seed(0))
    assert len(b) == 12 and sorted(b.group_id.view(3, 4)[:, 0].tolist()) == [0, 1, 2]
    assert (b.group_id.view(3, 4) == b.group_id.view(3, 4)[:, :1]).all()


# ------------------------------------------------------------------ AReaL FIFO
def test_pop_oldest_order_once_and_staleness():
    buf = ReplayBuffer(capacity=8, max_seq_len=16)
    for i in range(6):  # group_id i, sampled by version i
        buf.add([traj([1], [i + 1], group_id=i, version=i)], trainer_version=i)
    assert take_oldest(buf.snapshot_meta(), 3, None, 0) == [0, 1, 2]
    assert buf.pop_oldest(2, None, 5).group_id.tolist() == [0, 1]
    assert buf.pop_oldest(2, None, 5).group_id.tolist() == [2, 3]
    assert buf.pop_oldest(3, None, 5) is None  # only 2 left; nothing consumed
    assert buf.stats()["n_unconsumed"] == 2
    buf.add([traj([1], [9], group_id=6, version=6)], trainer_version=6)
    # current 8, max_staleness 2: min_version < 6 is stale -> groups 4, 5 dropped for good
    assert buf.pop_oldest(1, 2, 8).group_id.tolist() == [6]
    assert buf.pop_oldest(1, None, 8) is None
    assert buf.stats()["n_unconsumed"] == 0


# ------------------------------------------------------------------ persistence
def test_save_load_round_trip(tmp_path):
    buf = ReplayBuffer(capacity=5, max_seq_len=12, pad_id=3)
    buf.add(random_trajs(7, seed=4), trainer_version=2)
    buf.pop_oldest(1, None, 2)
    buf.save(tmp_path / "buf.pt")
    new = ReplayBuffer.load(tmp_path / "buf.pt")
    assert (new.capacity, new.max_seq_len, new.pad_id, new.n_added, len(new)) == (5, 12, 3, 7, 5)
    assert_batch_equal(new.get(range(5)), buf.get(range(5)))
    assert new.stats() == buf.stats()
    assert new.cols["tokens"].is_shared()
    new.add(random_trajs(1))
    assert new.n_added == 8 and buf.n_added == 7  # independent storage


def test_load_errors_name_the_path(tmp_path):
    bad = tmp_path / "garbage.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="garbage.pt"):
        ReplayBuffer.load(bad)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        ReplayBuffer.load(tmp_path / "missing.pt")
    torch.save({"x": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt"):
        ReplayBuffer.load(tmp_path / "other.pt")


def test_stats():
    buf = filled([(0, [1], 1.0, 0), (1, [2], 3.0, 2), (1, [3], 2.0, 2)], capacity=4)
    s = buf.stats()
    assert s["fill"] == 0.75 and s["n_added"] == 3 and s["mean_reward"] == 2.0
    assert s["version_hist"] == {0: 1, 2: 2}
