"""Continuous-batching KV-cache sampler: the engine of every generator process.

Runs inside one process (a generator, a benchmark, a test); owns its model copy, its
`KVCache` and its queue, so nothing here is shared or locked. Cross-process weight updates
arrive through `update_weights`, called by the generator loop between decode steps.

Schedule of one `step()`:
  1. admit: while a slot is free and a request waits, prefill its prompt once into the lowest
     free slot, copy that prompt KV into the other slots of its n samples (prefix sharing),
     and sample each sample's first token from the prefill's last logits;
  2. decode: one forward over rows 0..hi-1 (hi = highest busy slot + 1) advances every busy
     slot by one token; idle rows inside that range compute garbage into their own row;
  3. finish: a sample that drew a stop token or reached max_new_tokens / max_seq_len frees
     its slot at once, so step 1 refills it next step (short answers never wait for long).

Interruption (AReaL): `update_weights(fn, version, mode="interrupt")` loads weights now and
re-prefills every in-flight sample (prompt + generated tokens but the last, which is not yet
in the cache) under them; tokens already generated keep their log-probs and versions.
mode="finish" (TBA sync points) stops admitting, lets in-flight samples end on the old
weights, then loads. Always change weights through `update_weights`: on CPU the sampler keeps a
transposed copy of the lm_head (see `_logits`) that only `update_weights` refreshes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from common.kv_cache import KVCache
from common.sampling import Completion, SamplingParams, sample


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    next_sample: int = 0  # samples 0..next_sample-1 have been admitted


@dataclass
class _Seq:  # one in-flight sample occupying one slot
    req: _Request
    out: Completion
    pos: int = 0          # cache position the pending token will be written at
    stops: frozenset = field(default_factory=frozenset)


class Sampler:
    def __init__(self, model, max_batch: int = 32, max_seq_len: int = 1024, version: int = 0, seed: int = 0):
        self.model, self.max_batch, self.max_seq_len = model, max_batch, max_seq_len
        dev = model.device
        self.cache = KVCache(model.cfg, max_batch, max_seq_len, model.dtype, dev)
        self.version = version                      # stamped on every token sampled from now on
        self.generator = torch.Generator(device=dev).manual_seed(seed)
        self.queue: deque[_Request] = deque()
        self.slots: list[_Seq | None] = [None] * max_batch
        # per-slot decode inputs, updated in place (no per-step tensor building)
        self.next_tok = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.temp = torch.ones(max_batch, device=dev)
        self.top_k = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.top_p = torch.ones(max_batch, device=dev)
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=dev)  # idle rows decode at pos 0
        self._head_t = None  # CPU only: lm_head weight transposed, see _logits
        self._next_id = 0
        self._pending_update = None  # (fn, version) waiting for mode="finish"
        self.stats = {"prefill_tokens": 0, "decode_steps": 0, "decode_tokens": 0, "interrupts": 0}

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt, params: SamplingParams) -> None:
        params.validate()
        if len(prompt) == 0:
            raise ValueError("empty prompt: need at least one token")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_seq_len={self.max_seq_len} "
                             f"(needs room for at least one generated token)")

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

    def _logits(self, tokens, **kv) -> torch.Tensor:
        """Last-position logits (B, V). On CPU the lm_head runs as h @ W^T from a contiguous
        transposed copy: for one row that GEMV streams the 113 MB SmolLM2 head at ~25 GB/s vs
        ~13 GB/s through F.linear (measured on the 2-core dev box); the copy is refreshed
        whenever weights change (`_apply`)."""
        h = self.model.hidden(tokens, **kv)[:, -1]  # (B, D)
        if self.model.device.type != "cpu":
            return self.model.lm_head(h)
        if self._head_t is None:
            self._head_t = self.model.lm_head.weight.detach().t().contiguous()  # (D, V)
        return h @ self._head_t

    @torch.inference_mode()
    def _apply(self, load_fn, version: int) -> None:
        loaded = load_fn(self.model)
        self._head_t = None  # stale: rebuilt from the new weights at the next forward
        self.version = loaded if isinstance(loaded, int) else version
        self._pending_update = None
        for s, seq in enumerate(self.slots):
            if seq is None:
                continue
            # The cache holds prompt + tokens[:-1]; tokens[-1] is pending (fed at the next decode).
            ctx = seq.req.prompt + seq.out.tokens[:-1]
            self.model.hidden(torch.tensor([ctx], device=self.model.device), cache=self.cache, slot=s)
            seq.out.n_interrupts += 1
            self.stats["interrupts"] += 1
            self.stats["prefill_tokens"] += len(ctx)

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
        return out

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> list[Completion]:
        finished = []
        while self.queue and self._pending_update is None:
            free = [s for s, q in enumerate(self.slots) if q is None]
            if not free:
                break
            req = self.queue[0]
            take = free[:req.params.n - req.next_sample]
            P = len(req.prompt)
            logits = self._logits(torch.tensor([req.prompt], device=self.model.device),
                                  cache=self.cache, slot=take[0])  # (1, V)
            self.cache.copy_prefix(take[0], take[1:], P)
            self.stats["prefill_tokens"] += P
            p = req.params
            rows = torch.tensor(take, device=self.pos.device)
            self.temp[rows], self.top_k[rows], self.top_p[rows] = p.temperature, p.top_k, p.top_p
            self.pos[rows] = P
            self.active[rows] = True
            for s in take:
                comp = Completion(req.request_id, req.next_sample, req.prompt)
                req.next_sample += 1
                self.slots[s] = _Seq(req, comp, P, frozenset(p.stop_token_ids))
            tok, lp = sample(logits.expand(len(take), -1), self.temp[rows], self.top_k[rows], self.top_p[rows],
                             self.generator)
            finished += self._record(take, tok.tolist(), lp.tolist())
            if req.next_sample == p.n:
                self.queue.popleft()
        return finished

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
            else:
                self.next_tok[s] = t
        return finished

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Admit, decode one token for every busy slot, return the samples that finished."""
        if self._pending_update is not None and self.num_active == 0:
            self._apply(*self._pending_update)
        finished = self._admit()
        busy = [s for s, q in enumerate(self.slots) if q is not None]
        if not busy:
            return finished
        hi = busy[-1] + 1
        active = self.active[:hi]
        pos = torch.where(active, self.pos[:hi], 0)  # idle rows write garbage at their own position 0
        self.cache.prepare_decode(pos)
        logits = self._logits(self.next_tok[:hi, None], cache=self.cache, input_pos=pos)  # (hi, V)
        tok, lp = sample(logits, self.temp[:hi], self.top_k[:hi], self.top_p[:hi], self.generator)
        self.pos[:hi] += active
        for s in busy:
            self.slots[s].pos += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(busy)
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
            from tqdm import tqdm
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
