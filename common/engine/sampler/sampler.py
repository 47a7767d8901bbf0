"""Continuous-batching KV-cache sampler: the engine of every generator process.

Runs inside one process (a generator, a benchmark, a test); owns its model copy, its KV cache
(`kv_budget.make_cache`), its per-slot device state (`Rows`) and its queue: nothing here is shared or
locked. Cross-process weight updates arrive through `update_weights`, called by the generator
loop between decode steps.

Schedule of one `step()`:
  0. reserve: every running sample gets the KV page its next column needs; a pool that is short
     preempts the youngest (`common/engine/sampler/preempt.py`; the static cache is never short);
  1. admit: preempted samples resume first; then, while slots are free, the KV pool has pages
     and requests wait (first come, first served), give each sample the lowest free slot; the
     prompts of newly admitted requests are prefilled together (right-padded, up to
     `prefill_tokens` padded tokens per forward) into the lowest free prompt entries of the cache,
     which all n samples of a request share (never copied; see `common/engine/kv/paged_cache.py`);
     every admitted sample draws its first token from its prompt's last logits (kept while
     samples of the request still wait for slots);
  2. compact: if the queue left holes below the highest busy slot, move the highest busy slots
     down into them (likewise prompt entries), so the busy slots are rows 0..hi-1;
  3. decode: `decode_step` (`common/engine/sampler/decode.py`) advances rows 0..hi-1 by one token,
     eagerly or as a replayed CUDA graph (`cuda_graphs=True`); the new tokens and log-probs come
     back to the host in one transfer;
  4. finish: a sample that drew a stop token or reached max_new_tokens / max_seq_len frees its
     slot and its pages at once, so step 1 refills it next step (short answers never wait for
     long); a prompt entry is freed when its last sample finishes.
With `overlap=True`, step 3 launches step t+1 before step 4 records step t, so on a GPU the host's
bookkeeping runs while the device computes (one step of lag, the same samples:
`common/engine/sampler/inflight.py`). The bookkeeping of steps 2 and 4 (which request holds which slot
and entry, compaction, the step's membership, handing finished samples out) is `LiveBatch`'s
(common/engine/sampler/live_batch.py).

Interruption (AReaL): `update_weights(fn, version, mode="interrupt")` loads weights now and
re-prefills every live prompt, then every in-flight sample's generated tokens but the last
(which is not yet in the cache) after it, both batched; tokens already generated keep their
log-probs and versions. mode="finish" (TBA sync points) stops admitting, lets in-flight samples
end on the old weights, then loads.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from common.engine.sampler.decode import GraphedDecode, Rows, Shape, captured_shape, decode_step
from common.engine.sampler.decode_attention import flash_available
from common.engine.sampler.decode_model import DecodeModel
from common.engine.sampler.inflight import HostRing, Launched
from common.engine.kv.budget import make_cache
from common.engine.model.linear import bf16_packing_available
from common.engine.sampler.live_batch import LiveBatch, Request, Seq
from common.engine.sampler.preempt import Preemption
from common.engine.sampler.sampling import Completion, SamplingParams
from common.engine.sampler.slot_log import SlotLog
from common.contracts.progress import SampleBar

PREFILL_TOKENS = 8192  # padded tokens per prefill forward, by default (the memory plan counts its activations)


class Sampler(Preemption, LiveBatch):
    def __init__(self, model, max_batch: int = 32, max_seq_len: int = 1024, version: int = 0, seed: int = 0,
                 max_prompt_len: int | None = None, kv_dtype: torch.dtype | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, cuda_graphs: bool | None = None, static_shapes: bool = False,
                 compile: bool | None = None, flash: bool | None = None, overlap: bool | None = None,
                 packed: bool | None = None, kv_tokens: int | None = None, page_size: int | None = None,
                 kv_layout: str | None = None):
        """max_seq_len bounds prompt + completion; max_prompt_len (default max_seq_len - 1)
        bounds prompts and sizes the cache's prompt store (memory: see `common/engine/kv/static_cache.py`).
        kv_dtype: the cache's (and attention's) dtype, default `model.kv_dtype` (set from the
        run's `Precision`: fp32 with bf16 weights where the machine attends faster in fp32),
        else the model's dtype. prefill_tokens: padded tokens per prefill forward.
        cuda_graphs: decode through CUDA graphs captured per batch bucket (CUDA only; see
        `common/engine/sampler/decode.py`); None = `model.decode_graphs` (the run's --gen.cuda_graphs, set by
        the trainer on the model it evaluates) where the model is on CUDA; static_shapes: run the
        captured shapes eagerly (tests). compile: the decode step's layer body through torch.compile
        (`common/engine/sampler/decode_model.py`); None = `model.decode_compile` (the run's `--precision.decode`),
        else on for CUDA; flash: decode attention through the flash kernel (None: where available);
        overlap: launch each decode step before recording the previous one (module docstring);
        None = `model.decode_overlap` (the run's --gen.overlap, set by the trainer on the model it evaluates);
        packed: the decode GEMMs on weights packed for oneDNN (CPU, bf16 weights: `decode_model.py`);
        None = `model.decode_packed` (the run's `--precision.decode_gemm`) where it applies.
        kv_layout: "paged" (default: `model.kv_layout`, else paged) or "static" (`kv/static_cache.py`);
        kv_tokens: the paged pool's budget in tokens, prompts and samples together (None:
        `model.kv_tokens`, else `default_kv_tokens`); past it the youngest samples are preempted
        (`common/engine/sampler/preempt.py`); page_size: tokens per page (None: `PAGE_SIZE` for the device)."""
        self.model, self.max_batch, self.max_seq_len = model, max_batch, max_seq_len
        self.max_positions = getattr(model, "max_positions", None)  # a hard limit (GPT-2, Gemma 3's windows)
        if self.max_positions is not None:
            model.check_positions(max_seq_len, f"max_seq_len={max_seq_len} (prompt + max_new_tokens)")
        self.max_prompt_len = min(max_prompt_len or max_seq_len - 1, max_seq_len - 1)
        self.prefill_tokens = prefill_tokens
        dev = model.device
        kv_dtype = kv_dtype or getattr(model, "kv_dtype", None) or model.dtype
        self.cache = make_cache(model, max_batch, max_seq_len, self.max_prompt_len, kv_dtype, kv_layout, kv_tokens,
                                page_size)
        self.entries: list[Request | None] = [None] * self.cache.max_prefixes  # prompt store owners
        self.version = version                      # stamped on every token sampled from now on
        self.seed = seed                            # with request id, sample index and token index: the uniforms
        self.queue: deque[Request] = deque()
        self.preempted: list = []  # (Seq, saved SlotLog row) of preempted samples, oldest first (`preempt.py`)
        self._order = 0            # admission counter (Seq.order)
        self.slots: list[Seq | None] = [None] * max_batch
        self.rows = Rows.allocate(max_batch, self.cache.max_prefixes, dev)
        self.log = SlotLog(max_batch, max_seq_len)  # host: tokens, log-probs, versions per slot
        if cuda_graphs is None:
            cuda_graphs = bool(getattr(model, "decode_graphs", False)) and dev.type == "cuda"
        if compile is None:
            compile = getattr(model, "decode_compile", None)
            compile = dev.type == "cuda" if compile is None else compile
        if flash is None:
            flash = flash_available(dev, kv_dtype)
        can_pack = dev.type == "cpu" and model.dtype == torch.bfloat16 and bf16_packing_available()
        if packed and not can_pack:
            raise ValueError("Sampler(packed=True) needs bf16 weights on a CPU whose PyTorch packs bf16 for oneDNN")
        packed = can_pack and bool(getattr(model, "decode_packed", False)) if packed is None else packed
        self.dec = DecodeModel(model, compile=compile, flash=flash, packed=packed)
        self.graphed = GraphedDecode(self.dec, self.cache, self.rows) if cuda_graphs else None
        self.static_shapes = static_shapes or cuda_graphs
        self._next_id = 0
        self._pending_update = None  # (fn, version) waiting for mode="finish"
        self.overlap = bool(getattr(model, "decode_overlap", False)) if overlap is None else overlap
        # sampled tokens and log-probs on their way to the host: under overlap at most three at once
        # (the step in flight, an admission's first tokens, the step just launched)
        self._outs = HostRing((2 * max_batch,), torch.float64, dev, n=3, reads=True)
        self._inflight: Launched | None = None  # overlap: the step launched, not yet recorded
        self._ready: list[Completion] = []      # finished by a `_drain` (a weight update, an abort): the next step's
        # The busy slots and what a step's shape needs of them change only when samples start, end
        # or move: `_membership` is recomputed then (`_changed`), not every step (host time per step
        # is what must hide behind a captured step's device time: BENCHMARKS.md)
        self._epoch, self._members, self._compacted, self._plan_key = 0, None, -1, None
        self.stats = {"prefill_tokens": 0, "prefill_forwards": 0, "decode_steps": 0, "decode_tokens": 0,
                      "decode_rows": 0, "interrupts": 0, "preemptions": 0, "reprefill_tokens": 0,
                      "kv_occupancy": 0.0, "kv_peak_occupancy": 0.0, **{f"{a}_{b}": 0 for a in ("run", "live")
                                                            for b in ("prompt_rows", "own_cols", "prompt_cols")}}

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt, params: SamplingParams) -> None:
        params.validate()
        if len(prompt) == 0:
            raise ValueError("empty prompt: need at least one token")
        if len(prompt) > self.max_prompt_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_seq_len={self.max_seq_len} / "
                             f"max_prompt_len={self.max_prompt_len} (needs room for at least one generated token)")
        if self.max_positions is not None and len(prompt) + params.max_new_tokens > self.max_positions:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} exceeds the "
                             f"{self.max_positions} positions this {self.model.cfg.model_type} model runs")
        self.cache.check_fits(len(prompt), min(params.max_new_tokens, self.max_seq_len - len(prompt)))

    def submit(self, prompt: list[int], params: SamplingParams, request_id: int | None = None) -> int:
        """Queue one prompt for `params.n` samples. A bad request raises here and is not queued."""
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params)
        rid = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, rid + 1)
        self.queue.append(Request(rid, prompt, params))
        return rid

    @property
    def num_active(self) -> int:
        """Samples in slots (not the preempted ones waiting to resume)."""
        return sum(s is not None for s in self.slots)

    @property
    def update_pending(self) -> bool:
        return self._pending_update is not None

    def has_work(self) -> bool:
        return (bool(self.queue) or self.num_active > 0 or bool(self.preempted) or self._pending_update is not None
                or bool(self._ready))

    # ------------------------------------------------------------------ weights
    def update_weights(self, load_fn, version: int, mode: str = "interrupt") -> None:
        """Apply new weights. `load_fn(model)` copies them in place (e.g. WeightStore.load_into);
        if it returns an int, that is the version actually loaded (it may be newer than `version`)."""
        if mode not in ("interrupt", "finish"):
            raise ValueError(f"update_weights mode={mode!r}: expected 'interrupt' or 'finish'")
        if mode == "finish" and (self.num_active > 0 or self.preempted):
            self._pending_update = (load_fn, version)  # applied by step() once the batch drains
            return
        self._apply(load_fn, version)

    @torch.inference_mode()
    def _apply(self, load_fn, version: int) -> None:
        self._drain()  # the step in flight was drawn under the old weights: recorded as such
        loaded = load_fn(self.model)
        self.dec.refresh()  # packed q/k/v and gate/up copies follow the new weights
        self.version = loaded if isinstance(loaded, int) else version
        self._pending_update = None
        self._prefill([r for r in self.entries if r is not None])  # each live prompt once, shared as before
        # then every in-flight sample's tokens but the pending last one, after its prompt
        self.stats["prefill_tokens"] += self._prefill_own([q for q in self.slots if q is not None])
        for seq in [q for q in self.slots if q is not None] + [q for q, _ in self.preempted]:
            seq.out.n_interrupts += 1  # a preempted sample resumes on the new weights
            self.stats["interrupts"] += 1

    def abort_all(self) -> list[Completion]:
        """Drop queued requests; return in-flight samples as partial, finish_reason 'interrupted'
        (and samples a step still in flight finished, as finished)."""
        self._drain()
        out, self._ready = self._ready, []
        for s, seq in enumerate(self.slots):
            if seq is not None:
                self.log.fill(s, seq.out)
                seq.out.finish_reason = "interrupted"
                out.append(seq.out)
                self.slots[s] = None
                self.cache.close_slot(s)
        out += self._abort_preempted()
        for e, r in enumerate(self.entries):
            if r is not None:
                self.cache.close_entry(e)
        self.rows.active.zero_()
        self.queue.clear()
        self.entries = [None] * len(self.entries)
        self._changed()
        return out

    # ------------------------------------------------------------------ scheduling (admission and the rest: LiveBatch)
    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Admit, decode one token for every busy slot, return the samples that finished."""
        if self._pending_update is not None and self.num_active == 0 and not self.preempted:
            self._apply(*self._pending_update)
        self._reserve()  # pages for the running samples' next columns, preempting if short (`preempt.py`)
        finished, self._ready = self._ready, []
        firsts = self._admit()
        if firsts is not None and not self.overlap:
            finished += self._collect(firsts)
            firsts = None
        self._compact()
        launched = self._launch()
        prev, self._inflight = self._inflight, None
        if prev is not None:  # overlap: step t is recorded while the device computes t + 1 ...
            finished += self._collect(prev)
        if firsts is not None:  # ... and so are the first tokens of the samples admitted for it
            finished += self._collect(firsts)
        if launched is not None:
            if self.overlap:
                self._inflight = launched
            else:
                finished += self._collect(launched)
        return finished

    def _launch(self) -> Launched | None:
        """Queue one decode step over the busy rows (and its output's copy to the host)."""
        members = self._membership()
        if members is None:
            return None
        busy_np, busy, seqs, hi, E, n, P, flags = members
        # S: own columns, the new one included; under overlap one more (the one a step in flight
        # writes; a new sample's first token, not yet recorded, goes to column 0 of a count of 0)
        live = Shape(B=hi, E=E, n=n, S=int(self.log.count[busy_np].max()) + self.overlap, P=P)
        shape = live
        if self.static_shapes:  # the shapes a captured step runs at (eagerly: tests compare them with the live ones)
            shape = captured_shape(live, self.max_batch, self.cache.max_prefixes, self.max_seq_len,
                                   self.max_prompt_len)
        self.cache.flush()  # page tables changed on the host go to the device (paged; before a capture reads them)
        lens = np.ones(hi, dtype=np.int64)  # own columns each row attends (idle rows: 1)
        lens[busy_np] = self.log.count[busy_np] + self.overlap
        self.cache.row_lengths(lens)
        self._kv_stats()
        if self._plan_key != (self._epoch, shape.B, shape.E, shape.n):
            self._plan(shape.B, shape.E, shape.n)
            self._plan_key = (self._epoch, shape.B, shape.E, shape.n)
        if self.graphed is not None:
            out = self.graphed(shape, *flags)
        else:
            out = decode_step(self.dec, self.cache, self.rows, shape, *flags)
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(busy)
        self.stats["decode_rows"] += shape.B  # rows computed, idle and padding ones included
        for name, sh in (("run", shape), ("live", live)):  # the step's shape vs the live batch's (graph padding)
            self.stats[f"{name}_prompt_rows"] += sh.E * sh.n  # query rows against shared prompts
            self.stats[f"{name}_own_cols"] += sh.S            # slot columns attended per row
            self.stats[f"{name}_prompt_cols"] += sh.P         # prompt columns attended per entry
        # the step's one device-to-host transfer: tokens and log-probs
        return Launched.send(self._outs, out, hi, cols=busy_np, slots=busy, slots_np=busy_np, seqs=seqs,
                             epoch=self._epoch)

    def generate(self, prompts: list[list[int]], params: SamplingParams, progress: bool | str = False) -> list[Completion]:
        """Sample params.n completions per prompt; results ordered by (prompt, sample). `progress`: a
        bar of the samples finished (`SampleBar`: an ETA only once a whole wave of rows has finished),
        labelled "generate" or with the string given.

        Every prompt is validated before any is queued: a bad one raises ValueError naming its
        index, and requests already queued by `submit` are left untouched."""
        for i, p in enumerate(prompts):
            try:
                self.check_request(p, params)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        if params.seed is not None:
            self.seed = params.seed
        ids = [self.submit(p, params) for p in prompts]
        want = set(ids)
        done: dict[tuple[int, int], Completion] = {}
        bar = SampleBar(len(prompts) * params.n, self.max_batch, progress if isinstance(progress, str) else "generate") \
            if progress else None
        while len(done) < len(prompts) * params.n:
            for c in self.step():
                if c.request_id in want:
                    done[(c.request_id, c.sample_idx)] = c
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[(r, j)] for r in ids for j in range(params.n)]
