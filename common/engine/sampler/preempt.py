"""Admission by pages and preemption: what the sampler does when its paged KV pool
(`common/engine/kv/paged_cache.py`) runs short. Runs inside the sampler's process, a base of `Sampler`
beside `LiveBatch` (whose state it shares: `slots`, `entries`, `log`, `rows`, `cache`, `queue`).

  reserve  before each step, every running sample gets the page its next column needs (the
           rows whose column crosses a page end; usually none). When the pool cannot give it:
           first the prompt entries of requests with no running sample are given back (their
           prompts are prefilled again when they are admitted), then the youngest running
           samples are preempted, until it can;
  preempt  a sample leaves its slot and gives back its own pages (and its prompt's, if it was
           its request's last running sample) but keeps its tokens, log-probs and versions;
  resume   at admission, before any new request, preempted samples come back oldest first, as
           pages allow: their prompt re-prefilled if its entry was given back, then their own
           tokens but the pending last one re-prefilled after it (the path a weight update
           takes, `LiveBatch._prefill_own`), their pending token restored.
A resumed sample draws exactly the tokens it would have drawn without preemption: a token's
uniform depends only on the request, the sample and the token's index (`sampling.py`), and the
cache holds the same K/V again (up to float rounding of a batched prefill against a decode).
Never a deadlock: a sample that could not fit the whole pool is refused at submit
(`PagedKVCache.check_fits`), and with every other sample preempted and every idle prompt given
back, the oldest one fits. With the static cache (`kv/static_cache.py`) no row is ever short: these
calls cost a comparison per step.
"""
from __future__ import annotations

from common.engine.kv.transfer import to_device
from common.engine.kv.pages import PoolExhausted
from common.engine.sampler.sampling import row_keys


class Preemption:
    """The sampler's paging steps (module docstring); `preempted` holds (Seq, saved log) pairs."""

    def _reserve(self) -> None:
        """Pages for every running sample's next column (under overlap the one after: `inflight.py`)."""
        members = self._membership()
        if members is None:
            return
        busy = members[0]
        short = busy[self.log.count[busy] + self.overlap > self.cache.room[busy]]
        for s in sorted(short.tolist(), key=lambda s: self.slots[s].order):  # oldest first
            seq = self.slots[s]
            while seq is not None and self.slots[s] is seq:  # preempted or finished meanwhile: nothing to grow
                try:
                    self.cache.grow_slot(s, int(self.log.count[s]) + self.overlap)
                    break
                except PoolExhausted:
                    self._make_room(seq)

    def _make_room(self, protect) -> None:
        """Free pages: an idle prompt entry, else preempt the youngest running sample (`protect`
        itself only when it is the youngest)."""
        if self._inflight is not None:  # record the step in flight first: counts are then exact
            self._drain()
            return  # the caller asks again with exact counts (a finished sample gave pages back)
        for req in self.queue:
            if req.live == 0 and req.entry >= 0 and req is not protect.req:
                self._close_entry(req)
                return
        running = [q for q in self.slots if q is not None]
        if len(running) == 1:
            raise RuntimeError(f"KV pool: the only running sample cannot grow ({self.cache.pool.n_free} of "
                               f"{self.cache.pool.n_pages} pages free); check_fits should have refused it")
        self._preempt(max(running, key=lambda q: q.order))

    def _preempt(self, seq) -> None:
        s = seq.slot
        self.preempted.append((seq, self.log.save(s)))
        self.preempted.sort(key=lambda p: p[0].order)  # resumed oldest first
        self.cache.close_slot(s)
        self.slots[s] = None
        self.rows.active.index_fill_(0, to_device([s], self.rows.active.device), False)
        seq.req.live -= 1
        seq.out.n_preemptions += 1
        if seq.req.live == 0 and seq.req.entry >= 0:  # its request's last running sample: the prompt goes too
            self._close_entry(seq.req)
        self.stats["preemptions"] += 1
        self._changed()

    def _resume(self, free: list[int]) -> list[int]:
        """Preempted samples back into `free` slots (module docstring); returns the slots left."""
        back, reopened = [], []
        while self.preempted and free:
            seq, saved = self.preempted[0]
            req, k = seq.req, len(saved[0])
            own = k + self.overlap  # own columns 0..k-1 (k - 1: the pending token), + the one in flight
            cost = self.cache.cost(len(req.prompt) if req.entry < 0 else 0, own)
            if not self.cache.has_room(cost, running=self.num_active > 0):
                break
            self.preempted.pop(0)
            self._open_entry(req, reopened, self.num_active > 0)  # its room is in `cost` above
            s = free.pop(0)
            self.cache.open_slot(s, req.entry, own)
            self.slots[s], seq.slot = seq, s
            self.log.restore(s, saved)
            req.live += 1
            back.append(seq)
        if not back:
            return free
        self._prefill(reopened)
        self.stats["reprefill_tokens"] += self._prefill_own(back)
        self.stats["reprefill_tokens"] += sum(len(r.prompt) for r in reopened)
        dev, slots = self.model.device, [q.slot for q in back]
        keys = row_keys(self.seed, to_device([q.out.request_id for q in back], dev),
                        to_device([q.out.sample_idx for q in back], dev))
        rows = self.rows.start(slots, [len(q.req.prompt) for q in back], [q.req.params for q in back], keys,
                               own=[int(self.log.count[s]) - 1 for s in slots])
        self.rows.tok[rows] = to_device([int(self.log.tok[s, self.log.count[s] - 1]) for s in slots], dev)
        self._changed()
        return free

    def _abort_preempted(self) -> list:
        """The preempted samples as partial completions, finish_reason 'interrupted' (`Sampler.abort_all`)."""
        out = []
        for seq, (tok, logp, ver, *_) in self.preempted:
            seq.out.tokens, seq.out.logp, seq.out.versions = tok.tolist(), logp.tolist(), ver.tolist()
            seq.out.finish_reason = "interrupted"
            out.append(seq.out)
        self.preempted = []
        return out

    def _kv_stats(self) -> None:
        occ = self.cache.occupancy()
        self.stats["kv_occupancy"] = occ
        self.stats["kv_peak_occupancy"] = max(self.stats["kv_peak_occupancy"], occ)

