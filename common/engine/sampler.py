"""Continuous-batching KV-cache sampler: the engine of every generator process.

Runs inside one process (a generator, a benchmark, a test); owns its model copy, its
`KVCache` and its queue, so nothing here is shared or locked. Cross-process weight updates
arrive through `update_weights`, called by the generator loop between decode steps.

Schedule of one `step()`:
  1. admit: while a slot is free and a request waits, prefill its prompt once into the lowest
     free prompt entry of the cache, which all n samples share (never copied; see
     `common/engine/kv_cache.py`), give each sample the lowest free slot, and sample each sample's
     first token from the prefill's last logits (kept for samples admitted later);
  2. compact: if the queue left holes below the highest busy slot, move the highest busy slots
     down into them (likewise prompt entries), so the busy slots are rows 0..hi-1;
  3. decode: one forward over rows 0..hi-1 advances every busy slot by one token;
  4. finish: a sample that drew a stop token or reached max_new_tokens / max_seq_len frees
     its slot at once, so step 1 refills it next step (short answers never wait for long); a
     prompt entry is freed when its last sample finishes.

Interruption (AReaL): `update_weights(fn, version, mode="interrupt")` loads weights now and
re-prefills every live prompt once, then every in-flight sample's generated tokens but the
last (which is not yet in the cache) after it; tokens already generated keep their log-probs
and versions.
mode="finish" (TBA sync points) stops admitting, lets in-flight samples end on the old
weights, then loads.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from common.engine.kv_cache import KVCache
from common.engine.sampling import Completion, SamplingParams, inv_temperature, sample


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    next_sample: int = 0  # samples 0..next_sample-1 have been admitted
    entry: int = -1       # its prompt's prefix entry in the cache, -1 before admission
    live: int = 0         # samples in flight; the entry is freed when all are admitted and done
    logits: torch.Tensor | None = None  # (1, V) last prompt logits / T_eff while samples wait for slots


@dataclass
class _Seq:  # one in-flight sample occupying one slot
    req: _Request
    out: Completion
    pos: int = 0          # absolute position of the pending token (prompt length + generated - 1)
    stops: frozenset = field(default_factory=frozenset)


def _hole_below(items: list) -> tuple[int, int] | None:
    """(highest busy index, lowest free index) if a free index lies below a busy one, else None."""
    free = next((i for i, x in enumerate(items) if x is None), None)
    busy = next((i for i in range(len(items) - 1, -1, -1) if items[i] is not None), None)
    return (busy, free) if free is not None and busy is not None and free < busy else None


class Sampler:
    def __init__(self, model, max_batch: int = 32, max_seq_len: int = 1024, version: int = 0, seed: int = 0,
                 max_prompt_len: int | None = None, kv_dtype: torch.dtype | None = None):
        """max_seq_len bounds prompt + completion; max_prompt_len (default max_seq_len - 1)
        bounds prompts and sizes the cache's prompt store (memory: see `common/engine/kv_cache.py`).
        kv_dtype: the cache's (and attention's) dtype, default `model.kv_dtype` (set from the
        run's `Precision`: fp32 with bf16 weights where the machine attends faster in fp32),
        else the model's dtype."""
        self.model, self.max_batch, self.max_seq_len = model, max_batch, max_seq_len
        self.max_prompt_len = min(max_prompt_len or max_seq_len - 1, max_seq_len - 1)
        dev = model.device
        kv_dtype = kv_dtype or getattr(model, "kv_dtype", None) or model.dtype
        self.cache = KVCache(model.cfg, max_batch, max_seq_len, kv_dtype, dev,
                             max_prompt_len=self.max_prompt_len)
        self.entries: list[_Request | None] = [None] * self.cache.max_prefixes  # prompt store owners
        self.version = version                      # stamped on every token sampled from now on
        self.generator = torch.Generator(device=dev).manual_seed(seed)
        self.queue: deque[_Request] = deque()
        self.slots: list[_Seq | None] = [None] * max_batch
        # per-slot decode inputs, updated in place (no per-step tensor building)
        self.next_tok = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=dev)   # absolute position of the pending token
        self.plen = torch.zeros(max_batch, dtype=torch.long, device=dev)  # prompt length: pos - plen = slot column
        self.temp = torch.ones(max_batch, device=dev)
        self.inv_t = torch.ones(max_batch, device=dev)  # 1 / T_eff, applied to the lm_head input
        self.top_k = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.top_p = torch.ones(max_batch, device=dev)
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=dev)  # idle rows decode at pos 0
        self._next_id = 0
        self._pending_update = None  # (fn, version) waiting for mode="finish"
        self.stats = {"prefill_tokens": 0, "decode_steps": 0, "decode_tokens": 0, "decode_rows": 0, "interrupts": 0}

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt, params: SamplingParams) -> None:
        params.validate()
        if len(prompt) == 0:
            raise ValueError("empty prompt: need at least one token")
        if len(prompt) > self.max_prompt_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_seq_len={self.max_seq_len} / "
                             f"max_prompt_len={self.max_prompt_len} (needs room for at least one generated token)")

    def submit(self, prompt: list[int], params: SamplingParams, request_id: int | None = None) -> int:
        """Queue one prompt for `params.n` samples. A bad request raises here and is not queued."""
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params)
        rid = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, rid + 1)
        self.queue.append(_Request(rid, prompt, params))
        return rid

    @property
    def num_active(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def update_pending(self) -> bool:
        return self._pending_update is not None

    def has_work(self) -> bool:
        return bool(self.queue) or self.num_active > 0 or self._pending_update is not None

    # ------------------------------------------------------------------ weights
    def update_weights(self, load_fn, version: int, mode: str = "interrupt") -> None:
        """Apply new weights. `load_fn(model)` copies them in place (e.g. WeightStore.load_into);
        if it returns an int, that is the version actually loaded (it may be newer than `version`)."""
        if mode not in ("interrupt", "finish"):
            raise ValueError(f"update_weights mode={mode!r}: expected 'interrupt' or 'finish'")
        if mode == "finish" and self.num_active > 0:
            self._pending_update = (load_fn, version)  # applied by step() once the batch drains
            return
        self._apply(load_fn, version)

    def _logits(self, tokens, inv_t, pos=None) -> torch.Tensor:
        """Last-position logits / T_eff (B, V), with the temperature applied to the lm_head's
        input (B, D) rather than its output (B, V); the head runs on the last position only.
        The cache's mode must have been set (`KVCache.begin_*`)."""
        h = self.model.hidden(tokens, cache=self.cache, pos=pos)[:, -1]  # (B, D)
        return self.model.lm_head(h * inv_t.to(h.dtype).unsqueeze(1))

    def _prefill_prompt(self, req: _Request) -> None:
        """Prompt K/V into the request's entry; keep its last logits while samples are unadmitted."""
        self.cache.begin_prompt(req.entry)
        tokens = torch.tensor([req.prompt], device=self.model.device)
        if req.next_sample < req.params.n:
            inv_t = inv_temperature(torch.tensor([req.params.temperature], device=self.model.device))
            req.logits = self._logits(tokens, inv_t)
        else:
            self.model.hidden(tokens, cache=self.cache)
        self.stats["prefill_tokens"] += len(req.prompt)

    @torch.inference_mode()
    def _apply(self, load_fn, version: int) -> None:
        loaded = load_fn(self.model)
        self.version = loaded if isinstance(loaded, int) else version
        self._pending_update = None
        for req in self.entries:  # each live prompt once, shared by its samples as before
            if req is not None:
                self._prefill_prompt(req)
        dev = self.model.device
        for s, seq in enumerate(self.slots):
            if seq is None:
                continue
            # The slot holds tokens[:-1]; tokens[-1] is pending (fed at the next decode).
            own = seq.out.tokens[:-1]
            if own:
                P = len(seq.req.prompt)
                self.cache.begin_continuation(s, seq.req.entry, P)
                pos = torch.arange(P, P + len(own), device=dev).unsqueeze(0)
                self.model.hidden(torch.tensor([own], device=dev), cache=self.cache, pos=pos)
                self.stats["prefill_tokens"] += len(own)
            seq.out.n_interrupts += 1
            self.stats["interrupts"] += 1

    def abort_all(self) -> list[Completion]:
        """Drop queued requests; return in-flight samples as partial, finish_reason 'interrupted'."""
        out = []
        for s, seq in enumerate(self.slots):
            if seq is not None:
                seq.out.finish_reason = "interrupted"
                out.append(seq.out)
                self.slots[s] = None
                self.active[s] = False
        self.queue.clear()
        self.entries = [None] * len(self.entries)
        return out

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> list[Completion]:
        finished = []
        while self.queue and self._pending_update is None:
            free = [s for s, q in enumerate(self.slots) if q is None]
            if not free:
                break
            req, p = self.queue[0], self.queue[0].params
            take = free[:p.n - req.next_sample]
            rows = torch.tensor(take, device=self.pos.device)
            self.temp[rows], self.top_k[rows], self.top_p[rows] = p.temperature, p.top_k, p.top_p
            self.inv_t[rows] = inv_temperature(self.temp[rows])
            if req.entry < 0:  # first admission: prefill the prompt into a free prefix entry
                req.entry = self.entries.index(None)  # never fails: entries = max_batch + 1
                self.entries[req.entry] = req
                self._prefill_prompt(req)  # sets req.logits; an update re-prefills and resets them
            logits = req.logits  # (1, V), already / T_eff
            P = len(req.prompt)
            self.pos[rows] = P
            self.plen[rows] = P
            self.active[rows] = True
            for s in take:
                comp = Completion(req.request_id, req.next_sample, req.prompt)
                req.next_sample += 1
                req.live += 1
                self.slots[s] = _Seq(req, comp, P, frozenset(p.stop_token_ids))
            tok, lp = sample(logits.expand(len(take), -1), self.temp[rows] <= 0, self.top_k[rows],
                             self.top_p[rows], self.generator)
            finished += self._record(take, tok.tolist(), lp.tolist())
            if req.next_sample == p.n:
                self.queue.popleft()
                req.logits = None
                self._release(req)
        return finished

    def _compact(self) -> None:
        """Move the highest busy slot into the lowest free one (and likewise for prompt entries)
        until the busy ones are a prefix, so decode, which runs over rows 0..hi-1, never computes
        idle rows. Only matters when the queue cannot refill freed slots (the tail of a batch,
        where decode would otherwise compute many idle rows: BENCHMARKS.md, "Sampler"). A move
        copies the sample's own K/V (t columns)."""
        per_slot = (self.next_tok, self.pos, self.plen, self.temp, self.inv_t, self.top_k, self.top_p, self.active)
        while (move := _hole_below(self.slots)) is not None:
            src, dst = move
            seq = self.slots[src]
            self.cache.move_slot(src, dst, seq.pos - len(seq.req.prompt))  # columns already written
            for t in per_slot:
                t[dst] = t[src]
            self.slots[dst], self.slots[src] = seq, None
            self.active[src] = False
        while (move := _hole_below(self.entries)) is not None:
            src, dst = move
            req = self.entries[src]
            self.cache.move_entry(src, dst, len(req.prompt))
            self.entries[dst], self.entries[src] = req, None
            req.entry = dst

    def _release(self, req: _Request) -> None:
        """Free a request's prompt entry once all its samples were admitted and have finished."""
        if req.live == 0 and req.next_sample == req.params.n and req.entry >= 0:
            self.entries[req.entry] = None
            req.entry = -1

    def _record(self, rows: list[int], toks: list[int], lps: list[float]) -> list[Completion]:
        """Append each row's new token; free the rows whose sample is finished."""
        finished = []
        for s, t, lp in zip(rows, toks, lps):
            seq = self.slots[s]
            out = seq.out
            out.tokens.append(t)
            out.logp.append(lp)
            out.versions.append(self.version)
            if t in seq.stops:
                out.finish_reason = "stop"
            elif len(out.tokens) >= seq.req.params.max_new_tokens or seq.pos + 1 >= self.max_seq_len:
                out.finish_reason = "length"
            if out.finish_reason:
                finished.append(out)
                self.slots[s] = None
                self.active[s] = False
                seq.req.live -= 1
                self._release(seq.req)
            else:
                self.next_tok[s] = t
        return finished

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Admit, decode one token for every busy slot, return the samples that finished."""
        if self._pending_update is not None and self.num_active == 0:
            self._apply(*self._pending_update)
        finished = self._admit()
        self._compact()
        busy = [s for s, q in enumerate(self.slots) if q is not None]
        if not busy:
            return finished
        hi = busy[-1] + 1
        active = self.active[:hi]
        pos = torch.where(active, self.pos[:hi], 0)
        own = torch.where(active, self.pos[:hi] - self.plen[:hi], 0)  # idle rows write garbage at their column 0
        entry_of_row = [q.req.entry if q is not None else -1 for q in self.slots[:hi]]
        E = max(entry_of_row) + 1
        self.cache.begin_decode(own, entry_of_row, [len(r.prompt) if r else 0 for r in self.entries[:E]])
        logits = self._logits(self.next_tok[:hi, None], self.inv_t[:hi], pos=pos[:, None])  # (hi, V)
        tok, lp = sample(logits, self.temp[:hi] <= 0, self.top_k[:hi], self.top_p[:hi], self.generator)
        self.pos[:hi] += active
        for s in busy:
            self.slots[s].pos += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(busy)
        self.stats["decode_rows"] += hi  # rows computed, idle ones included
        tok, lp = tok.tolist(), lp.tolist()
        return finished + self._record(busy, [tok[s] for s in busy], [lp[s] for s in busy])

    def generate(self, prompts: list[list[int]], params: SamplingParams, progress: bool = False) -> list[Completion]:
        """Sample params.n completions per prompt; results ordered by (prompt, sample).

        Every prompt is validated before any is queued: a bad one raises ValueError naming its
        index, and requests already queued by `submit` are left untouched."""
        for i, p in enumerate(prompts):
            try:
                self.check_request(p, params)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        ids = [self.submit(p, params) for p in prompts]
        want = set(ids)
        done: dict[tuple[int, int], Completion] = {}
        bar = None
        if progress:
            bar = tqdm(total=len(prompts) * params.n, desc="generate", unit="sample")
        while len(done) < len(prompts) * params.n:
            for c in self.step():
                if c.request_id in want:
                    done[(c.request_id, c.sample_idx)] = c
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[(r, j)] for r in ids for j in range(params.n)]
