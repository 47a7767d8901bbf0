"""The host side of a paged KV cache: a pool of fixed-size pages, a free list with refcounts, and the
page tables of prompts and samples. Runs in a generator process, beside its sampler; it holds no
tensor (the K/V pages themselves are the sampler's), only which page holds which tokens.

A prompt's pages are shared by its n samples (refcount 1 + n while the prompt is live); a sample's
own tokens go to pages of its own, taken as it generates (a page when its last one is full) and
given back when it finishes or is preempted. So memory follows the tokens that are live, not
`max_batch x max_seq_len`. Nothing here blocks: a request the free pages cannot meet raises
`PoolExhausted` and changes nothing, and the caller decides (admit later, or preempt the youngest).

    pool = PagePool(n_pages=64, page_size=256)
    prompt = PageTable(pool); prompt.grow(300)           # 2 pages
    s = [prompt.fork() for _ in range(4)]                # the prompt's pages, shared (refcount 5)
    s[0].grow(1)                                         # a fresh page of its own
    for t in s: t.release()
    prompt.release()                                     # every page free again

The sampler's paged cache (`kv/paged_cache.py`) keeps one table per prompt entry and per slot, and
writes them to the device; admission and preemption (`preempt.py`) decide from `can_take`.
"""
from __future__ import annotations

from collections import deque


class PoolExhausted(RuntimeError):
    """Not enough free pages for a request; nothing was taken."""


def sample_kv_tokens(prompt_tokens: int, max_new_tokens: int, page_size: int) -> int:
    """The KV pool, in tokens, one sample needs to finish with the whole pool to itself: its prompt's
    pages (which its n samples share: counted once) and, from a fresh page on, its own for
    `max_new_tokens` + 1 (the column a decode step in flight may write past the end: `inflight.py`),
    in whole pages. The one rule of the sampler's refusal (`PagePool.check_fits`), the run's check
    before its workers start, the config's range check and the memory plan."""
    def pages(n):
        return -(-n // page_size)
    return (pages(prompt_tokens) + pages(max_new_tokens + 1)) * page_size


class PagePool:
    """`n_pages` pages of `page_size` tokens each: which are free, and how many tables hold each."""

    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs n_pages >= 1 and page_size >= 1, got {n_pages}, {page_size}")
        self.n_pages, self.page_size = n_pages, page_size
        self.free: deque[int] = deque(range(n_pages))
        self.ref = [0] * n_pages

    @classmethod
    def for_tokens(cls, kv_tokens: int, page_size: int) -> "PagePool":
        """The pool that a budget of `kv_tokens` tokens buys (whole pages, rounded down)."""
        return cls(kv_tokens // page_size, page_size)

    def pages_for(self, tokens: int) -> int:
        """Pages that `tokens` tokens take, from the start of a page."""
        return -(-tokens // self.page_size)

    @property
    def n_free(self) -> int:
        return len(self.free)

    def occupancy(self) -> float:
        """The fraction of pages in use."""
        return 1.0 - self.n_free / self.n_pages

    def can_take(self, n: int, watermark: int = 0) -> bool:
        """Whether `n` pages can be taken and `watermark` still left free (admission keeps some back,
        so that the rows already running can grow)."""
        return n + watermark <= self.n_free

    def take(self, n: int) -> list[int]:
        """`n` free pages, each held once; PoolExhausted (nothing taken) if fewer are free."""
        if n > self.n_free:
            raise PoolExhausted(f"{n} pages asked, {self.n_free} of {self.n_pages} free "
                                f"({self.page_size} tokens a page)")
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
        return pages

    def hold(self, pages: list[int]) -> None:
        """One more holder of each page (a sample sharing its prompt's pages)."""
        for p in pages:
            if self.ref[p] < 1:
                raise ValueError(f"page {p} is free: only a held page can be shared")
            self.ref[p] += 1

    def drop(self, pages: list[int]) -> None:
        """One holder less of each page; a page nobody holds is free again."""
        for p in pages:
            if self.ref[p] < 1:
                raise ValueError(f"page {p} is already free (dropped twice)")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self.free.append(p)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse, with the numbers, a sample that could not finish even with the whole pool to itself
        (`sample_kv_tokens`): no amount of preemption would ever let it through."""
        need = sample_kv_tokens(prompt_tokens, max_new_tokens, self.page_size)
        if need > self.n_pages * self.page_size:
            raise ValueError(f"a sample of {prompt_tokens} prompt + {max_new_tokens} new tokens needs {need:,} tokens of "
                             f"KV pool ({need // self.page_size} pages of {self.page_size}); the pool has "
                             f"{self.n_pages * self.page_size:,}: raise gen.kv_tokens to {need:,} or more, or lower "
                             f"gen.max_new_tokens")


class PageTable:
    """The pages of one prompt or one sample, in token order, and how many tokens they hold. A
    sample's table starts as a `fork` of its prompt's: the shared pages are read-only to it (its
    first own token starts a fresh page), so `shared` pages lead and its own follow."""

    def __init__(self, pool: PagePool):
        self.pool, self.pages, self.tokens, self.shared = pool, [], 0, 0
        self.prompt_tokens = 0  # a fork: the tokens its shared pages really hold

    def fork(self) -> "PageTable":
        """A sample's table over this prompt's pages (held once more each)."""
        t = PageTable(self.pool)
        self.pool.hold(self.pages)
        t.pages, t.shared = list(self.pages), len(self.pages)
        t.tokens = t.shared * self.pool.page_size  # own tokens start on a fresh page
        t.prompt_tokens = self.tokens
        return t

    def own_tokens(self) -> int:
        return self.tokens - self.shared * self.pool.page_size

    def grow(self, n: int) -> list[int]:
        """Room for `n` more tokens: the pages that takes (maybe none); PoolExhausted, nothing taken,
        if the pool cannot give them."""
        size = self.pool.page_size
        need = self.pool.pages_for(self.tokens + n) - len(self.pages)
        new = self.pool.take(need) if need > 0 else []
        self.pages += new
        self.tokens += n
        assert len(self.pages) * size >= self.tokens
        return new

    def slot(self, i: int) -> tuple[int, int]:
        """(page, offset) of this table's token `i` (counting a fork's shared pages as full)."""
        if not 0 <= i < self.tokens:
            raise IndexError(f"token {i} of a table holding {self.tokens}")
        return self.pages[i // self.pool.page_size], i % self.pool.page_size

    def release(self) -> None:
        """Give every page back (a finished or preempted sample, a prompt whose samples all started)."""
        self.pool.drop(self.pages)
        self.pages, self.tokens, self.shared, self.prompt_tokens = [], 0, 0, 0
