"""The paged KV pool's host side (common/engine/kv/pages.py): pages taken as tokens arrive and given
back at the end, a prompt's pages shared by its samples and freed only when the last holder lets go,
an exhausted pool that refuses and changes nothing, and the invariants under a random schedule."""
import random

import pytest

from common.engine.kv.pages import PagePool, PageTable, PoolExhausted


def test_pages_follow_the_tokens_and_come_back():
    pool = PagePool.for_tokens(1000, 16)  # 62 pages
    assert pool.n_pages == 62 and pool.pages_for(0) == 0 and pool.pages_for(16) == 1 and pool.pages_for(17) == 2
    t = PageTable(pool)
    assert t.grow(5) and pool.n_free == 61  # the first token takes a page
    assert t.grow(11) == [] and pool.n_free == 61  # 16 tokens: still one page
    assert len(t.grow(1)) == 1 and t.slot(16) == (t.pages[1], 0) and t.slot(15) == (t.pages[0], 15)
    with pytest.raises(IndexError):
        t.slot(17)
    t.release()
    assert pool.n_free == 62 and pool.occupancy() == 0.0


def test_a_prompt_is_shared_by_its_samples_who_start_on_fresh_pages():
    pool = PagePool(16, 8)
    prompt = PageTable(pool)
    prompt.grow(10)  # 2 pages, the second holding 2 tokens
    samples = [prompt.fork() for _ in range(4)]
    assert pool.n_free == 14 and all(pool.ref[p] == 5 for p in prompt.pages)
    s = samples[0]
    assert s.shared == 2 and s.prompt_tokens == 10 and s.own_tokens() == 0
    new = s.grow(1)
    assert len(new) == 1 and new[0] not in prompt.pages and s.slot(s.tokens - 1) == (new[0], 0)
    prompt.release()  # every sample started: the prompt lets go, its samples still hold the pages
    assert pool.n_free == 13 and all(pool.ref[p] == 4 for p in samples[1].pages)
    for t in samples:
        t.release()
    assert pool.n_free == 16 and set(pool.free) == set(range(16))


def test_an_exhausted_pool_refuses_and_changes_nothing():
    pool = PagePool(4, 4)
    t = PageTable(pool)
    t.grow(12)
    with pytest.raises(PoolExhausted, match="2 pages asked, 1 of 4 free"):
        t.grow(5)
    assert t.tokens == 12 and len(t.pages) == 3 and pool.n_free == 1
    assert pool.can_take(1) and not pool.can_take(1, watermark=1)
    with pytest.raises(ValueError, match="dropped twice"):
        pool.drop([t.pages[0]] * 2)


def test_a_sample_that_could_never_fit_is_refused_with_the_numbers():
    pool = PagePool(10, 256)
    pool.check_fits(1000, 1500)  # 4 + 6 pages (1,501 own tokens: one past the last, a step in flight): the whole pool
    with pytest.raises(ValueError, match=r"1000 prompt \+ 1600 new tokens needs 2,816 tokens of KV pool \(11 pages of "
                                         r"256\); the pool has 2,560: raise gen.kv_tokens to 2,816"):
        pool.check_fits(1000, 1600)
    with pytest.raises(ValueError):
        PagePool(0, 16)


def test_a_random_schedule_keeps_every_page_accounted_for():
    """Prompts, forks, growth, preemption (release mid-way) and finishing in random order: the free
    pages and the held ones always partition the pool, each held page's refcount is its holders."""
    rng, pool = random.Random(0), PagePool(40, 4)
    live: list[PageTable] = []
    for _ in range(3000):
        op = rng.random()
        try:
            if op < 0.2:
                p = PageTable(pool)
                p.grow(rng.randint(1, 12))
                live += [p] + [p.fork() for _ in range(rng.randint(1, 3))]
            elif op < 0.7 and live:
                rng.choice(live).grow(rng.randint(1, 6))
            elif live:
                live.pop(rng.randrange(len(live))).release()
        except PoolExhausted:
            pass
        holders = [0] * pool.n_pages
        for t in live:
            for pg in t.pages:
                holders[pg] += 1
        assert holders == pool.ref
        assert sorted(pool.free) == [pg for pg in range(pool.n_pages) if holders[pg] == 0]
    for t in live:
        t.release()
    assert pool.n_free == pool.n_pages
