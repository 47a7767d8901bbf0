"""The sampler's live batch (common/engine/sampler/sampler.py): admitting waiting samples into free slots
(their prompts prefilled, their first tokens drawn), which request holds which slot and prompt
entry, moving the busy ones down so they stay a prefix (compaction), what a decode step's shape
needs of them (membership, recomputed only when samples start, end or move), and recording a
step's tokens and handing finished samples out. Runs inside the sampler's process.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.engine.kv.transfer import to_device
from common.engine.sampler.inflight import Launched
from common.engine.sampler.prefill import prefill_continuations, prefill_prompts
from common.engine.sampler.sampling import Completion, SamplingParams, row_keys, sample, uniforms


@dataclass
class Request:
    """One submitted prompt and its n samples."""
    request_id: int
    prompt: list[int]
    params: SamplingParams
    next_sample: int = 0  # samples 0..next_sample-1 have been admitted
    entry: int = -1       # its prompt's prefix entry in the cache, -1 before admission
    live: int = 0         # samples in flight; the entry is freed when all are admitted and done
    logits: torch.Tensor | None = None  # (V,) last prompt logits / T_eff while samples wait for slots


@dataclass
class Seq:
    """One in-flight sample occupying one slot (its tokens so far: the sampler's SlotLog, whose
    count - 1 is also the slot column of its pending token)."""
    req: Request
    out: Completion       # filled from the SlotLog when the sample is handed out
    slot: int             # the slot it holds now (compaction moves it)
    order: int = 0        # admission order: preemption takes the youngest (`preempt.py`)


def _compaction(items: list) -> tuple[list[int], list[int]]:
    """(src, dst): the busy indices above the lowest free ones, highest first, paired with the
    free indices below them, lowest first, so that the busy ones become a prefix."""
    free = [i for i, x in enumerate(items) if x is None]
    busy = [i for i in range(len(items) - 1, -1, -1) if items[i] is not None]
    pairs = [(b, f) for f, b in zip(free, busy) if f < b]  # free rises, busy falls: stop where they cross
    return [b for b, _ in pairs], [f for _, f in pairs]


class LiveBatch:
    """The live batch's bookkeeping, a base of `Sampler` (which holds the state: `slots`, `entries`,
    `rows`, `log`, `cache`, `version`, the membership cache `_epoch`, `_members`, `_compacted`, and
    `_inflight`, the step launched but not yet recorded (`Sampler(overlap=True)`))."""

    @staticmethod
    def _flags(params: list[SamplingParams]) -> tuple[bool, bool]:
        """(some row is top-k / top-p filtered, some row is greedy): work `sample` may skip."""
        return (any(p.top_k > 0 or p.top_p < 1 for p in params), any(p.temperature <= 0 for p in params))

    def _admit(self) -> Launched | None:
        """Give free slots to waiting samples: preempted ones first (`preempt.py`), then new ones
        first come first served, each while the KV pool has pages for it (its prompt's, when its
        request is new, and its first column's); prefill new prompts together; draw every new
        sample's first token in one call. Returns those tokens on their way to the host
        (`_collect` records them), or None if no new sample was admitted."""
        free = [s for s, q in enumerate(self.slots) if q is None]
        if self.preempted:
            free = self._resume(free)
        if not self.queue or self._pending_update is not None:
            return None
        plan: list[tuple[Request, list[int]]] = []
        new: list[Request] = []
        for req in self.queue:
            running = self.num_active > 0 or bool(plan)
            if not free or not self._open_entry(req, new, running):
                break
            take = []
            while free and req.next_sample + len(take) < req.params.n and \
                    self.cache.has_room(self.cache.cost(0, 1), running or bool(take)):
                take.append(free.pop(0))
                self.cache.open_slot(take[-1], req.entry, 1)  # its first own column
            if not take:
                break
            plan.append((req, take))
        if not plan:
            return None
        self._prefill(new)  # an update re-prefills live prompts and resets their logits
        dev, r = self.model.device, self.rows
        slots, logits, rids, sidx = [], [], [], []
        for req, take in plan:
            p, P = req.params, len(req.prompt)
            for s in take:
                self.slots[s] = Seq(req, Completion(req.request_id, req.next_sample, req.prompt), s, self._order)
                self._order += 1
                self.log.start(s, min(p.max_new_tokens, self.max_seq_len - P), p.stop_token_ids)
                rids.append(req.request_id)
                sidx.append(req.next_sample)
                req.next_sample += 1
                req.live += 1
            slots += take
            logits.append(req.logits.expand(len(take), -1))
            if req.next_sample == p.n:
                req.logits = None
        while self.queue and self.queue[0].next_sample == self.queue[0].params.n:
            self.queue.popleft()
        self._changed()
        params = [self.slots[s].req.params for s in slots]
        rows = r.start(slots, [len(self.slots[s].req.prompt) for s in slots], params,
                       row_keys(self.seed, to_device(rids, dev), to_device(sidx, dev)))
        tok, lp = sample(torch.cat(logits), r.greedy[rows], r.top_k[rows], r.top_p[rows],
                         uniforms(r.key[rows], torch.zeros_like(rows)), *self._flags(params))
        r.tok[rows] = tok
        slots_np = np.asarray(slots, dtype=np.int64)
        return Launched.send(self._outs, torch.stack((tok.double(), lp.double())), len(slots),
                             cols=np.arange(len(slots)), slots=slots, slots_np=slots_np,
                             seqs=[self.slots[s] for s in slots], epoch=self._epoch)

    def _prefill(self, reqs: list[Request]) -> None:
        """Prompts of `reqs` into their entries; keeps each request's last logits / T_eff (V,)
        while it has samples waiting for slots (`common/engine/sampler/prefill.py`)."""
        if not reqs:
            return
        temps = [r.params.temperature if r.next_sample < r.params.n else None for r in reqs]
        logits, forwards = prefill_prompts(self.model, self.cache, [r.prompt for r in reqs], [r.entry for r in reqs],
                                           temps, self.prefill_tokens)
        for r, lg in zip(reqs, logits):
            r.logits = lg
        self.stats["prefill_tokens"] += sum(len(r.prompt) for r in reqs)
        self.stats["prefill_forwards"] += forwards

    def _prefill_own(self, seqs: list[Seq]) -> int:
        """Each sample's generated tokens but the pending last one (not yet in the cache) into its
        slot, after its prompt, all in one forward (a weight update's interruption, a preempted
        sample's resume); returns the tokens prefilled."""
        seqs = [q for q in seqs if self.log.count[q.slot] > 1]
        if not seqs:
            return 0
        own = [self.log.tokens(q.slot)[:-1] for q in seqs]
        prefill_continuations(self.model, self.cache, [q.slot for q in seqs], [q.req.entry for q in seqs],
                              [len(q.req.prompt) for q in seqs], own, self.max_seq_len)
        self.stats["prefill_forwards"] += 1
        return sum(map(len, own))

    def _open_entry(self, req: Request, new: list, running: bool) -> bool:
        """A prompt entry for `req` if it has none, with its pages and its first sample's (False:
        the pool has no room now); a new one joins `new`, to be prefilled."""
        if req.entry >= 0:
            return True
        if not self.cache.has_room(self.cache.cost(len(req.prompt), 1), running):
            return False
        req.entry = self.entries.index(None)  # never fails: entries = max_batch + 1
        self.entries[req.entry] = req
        self.cache.open_entry(req.entry, len(req.prompt))
        new.append(req)
        return True

    def _compact(self) -> None:
        """Move the highest busy slots into the lowest free ones (and likewise for prompt entries)
        so the busy ones are a prefix, so decode, which runs over rows 0..hi-1, never computes
        idle rows. Only matters when the queue cannot refill freed slots (the tail of a batch,
        where decode would otherwise compute many idle rows: BENCHMARKS.md, "Sampler"). All of a
        step's moves are one copy per cache store and per row tensor (a few kernel launches,
        not a few per moved sample and layer)."""
        if self._compacted == self._epoch:  # nothing started or ended since the last compaction
            return
        src, dst = _compaction(self.slots)
        if src:
            # own columns written so far: count - 1, and under overlap the one a step in flight writes
            self.cache.move_slots(src, dst, int(self.log.count[src].max()) - 1 + self.overlap)
            si, di = (to_device(x, self.rows.tok.device) for x in (src, dst))
            for t in self.rows.per_slot():
                t[di] = t[si]
            self.rows.active.index_fill_(0, si, False)  # not `[si] = False`: its host value is a sync on CUDA
            self.log.move(src, dst)
            for s, d in zip(src, dst):
                self.slots[d], self.slots[s] = self.slots[s], None
                self.slots[d].slot = d
        src, dst = _compaction(self.entries)
        if src:
            self.cache.move_entries(src, dst, max(len(self.entries[s].prompt) for s in src))
            for s, d in zip(src, dst):
                self.entries[d], self.entries[s] = self.entries[s], None
                self.entries[d].entry = d
        self._changed()
        self._compacted = self._epoch

    def _changed(self) -> None:
        """Samples started, ended or moved: the step's membership is computed again."""
        self._epoch += 1
        self._members = None

    def _membership(self):
        """(busy slots as a numpy array and a list, their `Seq`s, B, E, n, P, flags) of the live batch, or None."""
        if self._members is None:
            busy = [s for s, q in enumerate(self.slots) if q is not None]
            if not busy:
                return None
            seqs = [self.slots[s] for s in busy]
            counts: dict[int, int] = {}
            for q in seqs:
                counts[q.req.entry] = counts.get(q.req.entry, 0) + 1
            self._members = (np.asarray(busy, dtype=np.int64), busy, seqs, busy[-1] + 1, max(counts) + 1,
                             max(counts.values()), max(len(q.req.prompt) for q in seqs),
                             self._flags([q.req.params for q in seqs]))
        return self._members

    def _release(self, req: Request) -> None:
        """Free a request's prompt entry once all its samples were admitted and have finished."""
        if req.live == 0 and req.next_sample == req.params.n and req.entry >= 0:
            self._close_entry(req)

    def _close_entry(self, req: Request) -> None:
        """Give back a request's prompt entry and its pages (admitted again, it is prefilled again)."""
        self.cache.close_entry(req.entry)
        self.entries[req.entry] = None
        req.entry, req.logits = -1, None

    def _record(self, slots: list[int], out: np.ndarray, slots_np: np.ndarray | None = None) -> list[Completion]:
        """Append each slot's new token (out: (2, len(slots)) float64, tokens and log-probs);
        free the slots whose sample is finished (a stop token, max_new_tokens or max_seq_len)."""
        slots_np = np.asarray(slots, dtype=np.int64) if slots_np is None else slots_np
        fin, stopped = self.log.append(slots_np, out[0].astype(np.int64), out[1], self.version)
        finished, done = [], slots_np[fin].tolist()
        for s, stop in zip(done, stopped[fin].tolist()):
            seq = self.slots[s]
            self.log.fill(s, seq.out)
            seq.out.finish_reason = "stop" if stop else "length"
            finished.append(seq.out)
            self.cache.close_slot(s)
            self.slots[s] = None
            seq.req.live -= 1
            self._release(seq.req)
        if done:
            self.rows.active.index_fill_(0, to_device(done, self.rows.active.device), False)
            self._changed()
        return finished

    def _collect(self, step: Launched) -> list[Completion]:
        """Record launched tokens (waiting for them on CUDA). Rows are matched to samples by
        identity: a sample that moved since the launch is recorded in its new slot, and a row whose
        sample ended meanwhile (computed once more under overlap: `inflight.py`) is dropped."""
        out = step.result()
        if step.epoch == self._epoch:  # nothing started, ended or moved since the launch
            return self._record(step.slots, out[:, step.cols], step.slots_np)
        keep = [j for j, q in enumerate(step.seqs) if self.slots[q.slot] is q]
        return self._record([step.seqs[j].slot for j in keep], out[:, step.cols[keep]])

    def _drain(self) -> None:
        """Record the step in flight now (before the weights change or the batch is dropped); the
        samples it finishes are handed out by the next `step`."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._ready += self._collect(step)

    def _plan(self, B: int, E: int, n: int) -> None:
        """The entry plan of rows 0..B-1 for a step over E entries of n query rows."""
        self.rows.write_plan([q.req.entry if q is not None else -1 for q in self.slots[:B]],
                             [len(r.prompt) if r is not None else 0 for r in self.entries[:E]], n)
