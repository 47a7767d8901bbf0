"""The generator process: pull weights, claim prompts, sample, score, write groups to the buffer.

Runs in each spawned generator process (`generator_main`); `Control` is shared with the
trainer. Data flow per finished prompt (a *group* of n samples):
    claim prompt index -> Sampler -> decode + reward_fn -> [reference log-probs] -> buffer.add
Weights: every decode step the generator compares `store.version` with its sampler's; a newer
one is applied at once ("interrupt", AReaL: in-flight KV recomputed) or after in-flight samples
finish ("finish", TBA sync points).

Admission (`Control.claim`), AReaL's staleness rule counted in prompts:
    started < quota,  quota = (max_staleness + v + 1) * prompts_per_version + dropped
v is the trainer's published version; started counts every prompt ever claimed (accepted +
running); dropped counts the groups the trainer's staleness filter dropped (started, never
trained: they give their places back). max_staleness = 0 is synchronous lock-step; None is
unbounded (TBA searchers); under `train.max_staleness=auto` the trainer moves it each step
(`set_bound`, common/runtime/staleness_control.py).
Concurrency: `Control.t` is a shared int64 tensor; claims and quota changes happen under
`Control.lock` (a few integer ops), the trainer is the only writer of version/quota.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import numpy as np
import torch

from common.contracts.batch import PromptSet, Scored, Trajectory
from common.contracts.config_check import any_finite, at_least, between, relation
from common.contracts.errors import UserError
from common.engine.machine.precision import Precision
from common.engine.checkpoints.peft_io import attach_lora
from common.engine.model.lora import LoRAConfig, Merger
from common.engine.kv.budget import PAGE_SIZE
from common.engine.kv.pages import sample_kv_tokens
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.contracts.ops import reference_seq_logp
from common.runtime.process import set_process_defaults
from common.runtime.reward_service import RewardClient, reward_failed
from common.runtime.watchdog import Beat

log = logging.getLogger("asyncrl.generator")
_UNBOUNDED = 2**62


@dataclass
class GenConfig:
    max_batch: int = 32             # sampler slots per generator process
    max_new_tokens: int = 256       # generated tokens per sample at most
    temperature: float = 0.7        # sampling temperature (log-probs recorded at it); 0 = greedy (log-probs at 1)
    top_p: float = 1.0              # nucleus mass; 1 = off
    top_k: int = 0                  # top-k; 0 = off
    n: int = 4                      # samples per prompt (the group size K)
    update_mode: Literal["finish", "interrupt"] = "finish"  # finish in-flight samples first (TBA) or re-prefill (AReaL)
    ref_logp: bool = True           # compute reference sequence log-probs here (TBA's KL term)
    queue_depth: int = 2            # prompts queued beyond what fits the free slots
    cuda_graphs: Optional[bool] = None  # decode through CUDA graphs captured per batch bucket; None = on CUDA, off on CPU
    overlap: Optional[bool] = None  # launch decode step t+1 before recording step t (same samples); None = with CUDA graphs
    prefill_tokens: int = 8192      # padded prompt tokens per prefill forward (several prompts per forward)
    memory_fraction: float = 0.0    # CUDA: cap on each generator's share of its GPU (shared with the trainer); 0 = no cap
    no_stop_reward: Optional[float] = None  # reward of a sample cut at max_new_tokens without a stop token (TL;DR paper: -1); None = score it
    error_reward: float = 0.0       # reward of a sample whose reward fn raised or was not finite (counted in reward_errors)
    kv_layout: Literal["paged", "static"] = "paged"  # KV cache: pages taken as tokens are generated, or a full row per slot
    kv_tokens: int = 0              # paged: the KV pool's budget in tokens per generator; 0 = CPU: static's size, CUDA: half the free memory
    kv_page_size: int = 0           # paged: tokens per KV page; 0 = by device (CPU 64, CUDA 256)

    CHECKS = {"max_batch": at_least(1), "max_new_tokens": at_least(1), "temperature": at_least(0),
              "top_p": between(0, 1, open_lo=True), "top_k": at_least(0), "n": at_least(1), "queue_depth": at_least(0),
              "prefill_tokens": at_least(1), "memory_fraction": between(0, 1), "no_stop_reward": any_finite(),
              "error_reward": any_finite(), "kv_tokens": at_least(0),
              "kv_page_size": relation(lambda v, s: v == 0 or (16 <= v <= 4096 and v & (v - 1) == 0),
                                       "0 (by device) or a power of two from 16 to 4096")}  # ranges (common/contracts/config_check.py);
    # kv_tokens against what one sample needs: RunConfig's rule (it knows the device), then the trainer
    # against the longest prompt (`check_kv_pool`)


def kv_page(cfg: GenConfig, device) -> int:
    """The page size a generator on `device` takes: `kv_page_size`, else the device's default."""
    return cfg.kv_page_size or PAGE_SIZE["cuda" if str(device).startswith("cuda") else "cpu"]


def check_kv_pool(cfg: GenConfig, device, prompt_tokens: int) -> None:
    """Refuse, before any generator starts, a `kv_tokens` pool (its whole pages) that holds no sample
    of a `prompt_tokens` prompt at full length (`kv_pages.sample_kv_tokens`, the sampler's own rule);
    the default pool (0) is sized to hold one by construction (on CUDA, from the memory it finds)."""
    if cfg.kv_layout != "paged" or not cfg.kv_tokens:
        return
    page = kv_page(cfg, device)
    need, pool = sample_kv_tokens(prompt_tokens, cfg.max_new_tokens, page), cfg.kv_tokens // page * page
    if pool < need:
        raise UserError(f"--gen.kv_tokens={cfg.kv_tokens}: a pool of {pool:,} tokens (whole pages of {page}) holds no "
                        f"sample of the longest prompt ({prompt_tokens} tokens) + gen.max_new_tokens "
                        f"({cfg.max_new_tokens}) + 1, which needs {need:,}: use --gen.kv_tokens={need} or more, or "
                        f"lower --gen.max_new_tokens (nothing was started)")


def decode_graphs(cfg: GenConfig, device) -> bool:
    """Whether a sampler on `device` decodes through captured CUDA graphs: `cfg.cuda_graphs`, or
    where it is None, on CUDA (a replay is one launch instead of one per kernel: the eager decode
    step is launch-bound on a GPU, BENCHMARKS.md)."""
    return torch.device(device).type == "cuda" if cfg.cuda_graphs is None else cfg.cuda_graphs


def decode_overlap(cfg: GenConfig, device) -> bool:
    """Whether a sampler on `device` launches each decode step before recording the last:
    `cfg.overlap`, or where it is None, where it decodes through CUDA graphs (the host's work per
    step then hides behind the device's: BENCHMARKS.md; on CPU a step is synchronous, nothing to hide)."""
    return decode_graphs(cfg, device) if cfg.overlap is None else cfg.overlap


class Control:
    """Shared admission gate and generator statistics (see module docstring)."""
    VERSION, STARTED, QUOTA, DONE_GROUPS = 0, 1, 2, 3
    STAT_FIELDS = ("tokens", "busy_s", "groups", "sync_s", "syncs", "reward_errors", "interrupts", "preemptions",
                   "reprefill_tokens", "kv_occupancy", "cuda_peak_bytes", "reward_timeouts", "reward_crashes",
                   "reward_refused")
    (TOKENS, BUSY_S, GROUPS, SYNC_S, SYNCS, REWARD_ERRORS, INTERRUPTS, PREEMPTIONS, REPREFILL_TOKENS,
     KV_OCCUPANCY, CUDA_PEAK_BYTES, REWARD_TIMEOUTS, REWARD_CRASHES, REWARD_REFUSED) = range(14)  # columns of `stats`
    REASON_COLUMN = {"timeout": REWARD_TIMEOUTS, "crashed": REWARD_CRASHES, "refused": REWARD_REFUSED}  # Scored's

    def __init__(self, ctx, prompts_per_version: int, max_staleness: Optional[int], n_generators: int = 1):
        self.t = torch.zeros(4, dtype=torch.int64).share_memory_()
        self.stats = torch.zeros(n_generators, len(self.STAT_FIELDS), dtype=torch.float64).share_memory_()
        self.lock = ctx.Lock()
        self.prompts_per_version, self.max_staleness = prompts_per_version, max_staleness
        self.dropped = 0  # trainer-side: groups given back (set_version)
        self.set_version(0)

    def set_version(self, v: int, started: int | None = None, dropped: int | None = None) -> None:
        """Trainer only: new published version -> new quota. `started` restores it on resume.
        `dropped`: groups the trainer's staleness filter has dropped so far; each gives its place
        back (it was counted as started but never trained: without this, every drop would narrow
        the window for good, and after eta x prompts_per_version of them no batch could ever fill)."""
        with self.lock:
            self.t[self.VERSION] = v
            if started is not None:
                self.t[self.STARTED] = started
            if dropped is not None:
                self.dropped = dropped
            eta = self.max_staleness
            self.t[self.QUOTA] = (_UNBOUNDED if eta is None else
                                  (eta + v + 1) * self.prompts_per_version + self.dropped)

    def set_bound(self, eta: Optional[int]) -> None:
        """Trainer only: a new staleness bound (`train.max_staleness=auto`) at the current version. A
        lower one pauses claims until the version catches up; no started prompt is withdrawn."""
        self.max_staleness = eta
        self.set_version(int(self.t[self.VERSION]))

    def claim(self) -> int | None:
        """Generator: the global index of the next prompt to start, or None if over quota."""
        with self.lock:
            s = int(self.t[self.STARTED])
            if s >= int(self.t[self.QUOTA]):
                return None
            self.t[self.STARTED] = s + 1
            return s

    def stat(self, rank: int) -> dict:
        return dict(zip(self.STAT_FIELDS, self.stats[rank].tolist()))


def prompt_order(seed: int, n_prompts: int, claim_idx: int) -> int:
    """Dataset index of the claim_idx-th prompt: a fresh seeded permutation every epoch."""
    epoch, i = divmod(claim_idx, n_prompts)
    return int(np.random.RandomState((seed * 1_000_003 + epoch) % 2**32).permutation(n_prompts)[i])


def score(completions, prompt_idx: int, prompts: PromptSet, reward_fn, tokenizer, stats_row,
          rank: int = 0, stop_event=None, beat=None, no_stop_reward: float | None = None,
          error_reward: float = 0.0) -> list[float] | None:
    """Rewards for one group; a reward_fn that raises scores `error_reward` and is counted, never
    fatal (the first failure in this process is logged with its traceback: `reward_failed`).
    `reward_fn` is fn(text, meta), or a RewardClient (reward-worker processes, batched; while
    waiting for it this generator keeps beating, so a stuck reward worker is the one named).
    With `no_stop_reward` set, a sample cut at max_new_tokens gets that value unscored."""
    meta = prompts.meta[prompt_idx] if prompts.meta else None
    cut = [no_stop_reward is not None and c.finish_reason == "length" for c in completions]
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) if tokenizer is not None else c.tokens
             for c, k in zip(completions, cut) if not k]
    out = []
    if texts and isinstance(reward_fn, RewardClient):
        got = reward_fn.score(rank, texts, [meta] * len(texts), stop_event, beat)
        if got is None:
            return None
        stats_row[Control.REWARD_ERRORS] += got[1]
        out = got[0]
    elif texts:
        for text in texts:
            try:
                r = reward_fn(text, meta)
                r = r if type(r) is Scored else float(r)
                if not math.isfinite(r):
                    raise ValueError(f"reward_fn returned {r}")
            except Exception as e:  # noqa: BLE001 - a bad sample must not kill a long run
                reward_failed("reward_fn", error_reward, e, f" on prompt {prompt_idx}")
                stats_row[Control.REWARD_ERRORS] += 1
                r = error_reward
            out.append(r)
    for r in out:  # a reward's reason, where it gave one (a program that timed out, crashed, was refused)
        if type(r) is Scored and r.reason:
            stats_row[Control.REASON_COLUMN[r.reason]] += 1
    scored = iter(out)
    return [no_stop_reward if k else float(next(scored)) for k in cut]


def _load(store, model, merger) -> int:
    """The published weights into `model`: all of them, or (LoRA) the adapters, folded into the base."""
    if merger is None:
        return store.load_into(model)
    v = store.load_into(model, subset=True)
    merger.merge()
    return v


def generator_main(rank: int, cfg: GenConfig, model_path: str, ref_path: Optional[str], store, buffer,
                   control: Control, prompts: PromptSet, reward_fn: Callable, seed: int, max_seq_len: int,
                   stop_token_ids: tuple, device: str, precision: Precision, *, stop_event, beat: Beat,
                   lora: LoRAConfig | None = None) -> None:
    """Process entry point (started by `common.runtime.launch.Workers.start`). `precision`: the
    trainer's resolved choice. `beat`: this worker's heartbeat (common/runtime/watchdog.py), called at
    least once per loop. `lora`: the trainer trains adapters (train.lora): the store holds them and each
    load folds them into this process's copy of the base (`Merger`); the reference, when it is the
    base, is this model with the base's weights swapped back (no second copy)."""
    beat.start()
    set_process_defaults(device)
    prec = precision.apply()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # kernels, graphs and IPC handles of this process on its own GPU
        if cfg.memory_fraction > 0:
            torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, dev)
    beat("loading")
    model, tok = prec.load(model_path, device=dev, role="generator")
    merger = Merger(model) if lora is not None and attach_lora(model, lora, freeze=False) else None
    own_ref = merger is not None and ref_path in (None, model_path)  # the base is this model without its adapters
    ref = (prec.load(ref_path, device=dev, tokenizer=False)[0] if (cfg.ref_logp and ref_path and not own_ref)
           else model if cfg.ref_logp and own_ref else None)
    while store.version < 0 and not stop_event.is_set():  # trainer publishes version 0 first
        beat("waiting")
        time.sleep(0.01)
    beat("applying_weights")
    if merger is None:
        store.bind(model)  # loads become one copy of the whole slot (same dtype), before graphs see the weights
    sampler = Sampler(model, max_batch=cfg.max_batch, max_seq_len=max_seq_len,
                      max_prompt_len=max(len(p) for p in prompts.tokens),
                      version=_load(store, model, merger), seed=seed * 1000 + rank, prefill_tokens=cfg.prefill_tokens,
                      cuda_graphs=decode_graphs(cfg, dev), overlap=decode_overlap(cfg, dev), kv_layout=cfg.kv_layout,
                      kv_tokens=cfg.kv_tokens or None, page_size=cfg.kv_page_size or None)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, n=cfg.n, stop_token_ids=tuple(stop_token_ids))
    row = control.stats[rank]
    groups: dict[int, tuple[int, list]] = {}  # request id -> (prompt index, finished completions)
    n_prompts = len(prompts.tokens)

    def load(m):  # copies the active weight buffer into m; returns the version it held
        beat("applying_weights", store.version)  # both modes come here ("finish": inside sampler.step())
        t = time.perf_counter()
        v = _load(store, m, merger)
        row[Control.SYNC_S] += time.perf_counter() - t
        row[Control.SYNCS] += 1
        return v

    while not stop_event.is_set():
        if store.version > sampler.version and not sampler.update_pending:
            sampler.update_weights(load, store.version, mode=cfg.update_mode)
        while len(sampler.queue) < cfg.queue_depth and not sampler.update_pending:
            i = control.claim()
            if i is None:
                break
            if i in groups:  # claimed twice (a counter written back on the store of several nodes): sampled once
                log.warning("generator %d: prompt claim %d is already in flight here; dropped the repeat", rank, i)
                continue
            if store.version > sampler.version and not sampler.update_pending:
                # the quota that admitted i moved after the trainer published (one node: the store first;
                # other nodes: every receiver's ack first), possibly after the check above: sample i with
                # the weights it was admitted under, or a sync run waits forever for rows of that version
                sampler.update_weights(load, store.version, mode=cfg.update_mode)
            p = prompt_order(seed, n_prompts, i)
            sampler.submit(prompts.tokens[p], params, request_id=i)  # request id = claim index
            groups[i] = (p, [])
        if not sampler.has_work():
            beat("waiting")  # for quota (the trainer's next version)
            time.sleep(0.005)
            continue
        t = time.perf_counter()
        beat("decoding")
        for c in sampler.step():
            if c.request_id not in groups:  # never claimed here, or its group already complete: nothing to add to
                log.warning("generator %d: a completion of unknown request %d; dropped", rank, c.request_id)
                continue
            p, g = groups[c.request_id]
            g.append(c)
            if len(g) < cfg.n:
                continue
            del groups[c.request_id]
            beat("scoring", c.request_id)
            rewards = score(g, p, prompts, reward_fn, tok, row, rank, stop_event, beat, cfg.no_stop_reward,
                            cfg.error_reward)
            if rewards is None:  # shutting down while the reward workers were busy
                break
            trajs = [Trajectory(torch.tensor(x.prompt_tokens), torch.tensor(x.tokens), x.logp_tensor(),
                                torch.tensor(x.versions), r, p, x.finish_reason) for x, r in zip(g, rewards)]
            if ref is not None:
                beat("reference", c.request_id)
                with merger.pristine() if ref is model else contextlib.nullcontext():  # LoRA: the base
                    ref_lp = reference_seq_logp(ref, trajs, cfg.temperature).tolist()
                for t_, rf in zip(trajs, ref_lp):
                    t_.ref_seq_logp = rf
            buffer.add(trajs, trainer_version=min(min(x.versions) for x in g))
            row[Control.GROUPS] += 1
            row[Control.TOKENS] += sum(len(x.tokens) for x in g)
        row[Control.BUSY_S] += time.perf_counter() - t
        row[Control.INTERRUPTS] = sampler.stats["interrupts"]
        row[Control.PREEMPTIONS] = sampler.stats["preemptions"]  # the paged KV pool (`common/engine/sampler/preempt.py`)
        row[Control.REPREFILL_TOKENS] = sampler.stats["reprefill_tokens"]
        row[Control.KV_OCCUPANCY] = sampler.stats["kv_occupancy"]
        if dev.type == "cuda":  # the memory plan's generator line, measured (a cheap counter read)
            row[Control.CUDA_PEAK_BYTES] = torch.cuda.max_memory_allocated(dev)
