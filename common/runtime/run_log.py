"""What a training run writes besides its checkpoints: the run directory with its config, one
metrics row per trainer step (staleness, throughput, the generators' statistics) and the console's
step line from it, and the evaluations. Runs in the trainer (rank 0); used by the trainer loop
(common/runtime/trainer.py) and by replays (common/replay.py), so a replayed run logs as a trained
one does.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from common.contracts.batch import Batch
from common.contracts.config import save_config
from common.contracts.run_files import record
from common.engine.model.lora import merged
from common.runtime.shared.buffer import ReplayBuffer
from common.runtime.generator import Control, decode_graphs, decode_overlap
from common.runtime.files.run_dir import open_run_dir


def evaluate_now(evaluate: Optional[Callable], group, prec, tok, logger, cfg, step: int, tag: str) -> dict:
    """evaluate(model, tokenizer) on the trainer's current weights, in the generators' dtype and
    decoding as they do (`--gen.cuda_graphs`, `--gen.overlap`, read by common/evaluate.py's Sampler); logged at `step`."""
    if evaluate is None:
        return {}
    t = time.perf_counter()
    group.model.eval()
    with merged(group.full_model()) as full:  # LoRA: the adapters folded in (the sampler reads the weights), undone after
        m = prec.inference_copy(full)
        m.decode_graphs, m.decode_overlap = decode_graphs(cfg.gen, m.device), decode_overlap(cfg.gen, m.device)
        out = evaluate(m, tok)
    group.model.train()
    out = {**out, "eval_s": time.perf_counter() - t}
    logger.log(step, **out)
    print(f"[asyncrl] eval ({tag}, step {step}): " + ", ".join(f"{k}={v:.4g}" for k, v in out.items()))
    return out


def prepare_run_dir(cfg, resume: bool) -> Path:
    """runs/<name>/ with the resolved config saved in it. An earlier run there is continued
    (resume), replaced (cfg.overwrite) or refused, never mixed into; a name that leaves run_root,
    or a folder this project did not make, is refused (common/runtime/files/run_dir.py)."""
    run_dir = open_run_dir(cfg, resume)
    record(run_dir / "config.json", run_dir / f".config.json.{os.getpid()}.tmp")  # save_config's rename, and its temporary
    save_config(cfg, run_dir / "config.json")
    return run_dir


def staleness(batch: Batch, version: int) -> tuple[list[int], float]:
    """Per row, versions between its oldest token and the weights that train on it (0 =
    on-policy); and the fraction of rows whose tokens came from more than one version."""
    v = batch.versions
    oldest = v.masked_fill(~batch.loss_mask, version).min(1).values
    newest = v.masked_fill(~batch.loss_mask, -1).max(1).values
    spans = ((newest > oldest) & batch.loss_mask.any(1)).float().mean().item()
    return (version - oldest).tolist(), spans


def step_row(batch: Batch, stats: dict, gnorm: float, lr: float, times: tuple, publish_s: float, version: int,
              stale: list[int], multi_version: float, control: Control, buffer: ReplayBuffer, gen_prev: tuple):
    """One trainer step's metrics row, and (generated tokens, time) for the next row's rate."""
    (t0, t1, t2), stats_of = times, control.stats
    gen_tok, now = stats_of[:, Control.TOKENS].sum().item(), time.perf_counter()
    row = dict(version=version, **{**stats, "reward_mean": batch.reward.mean().item()}, grad_norm=gnorm, lr=lr,
               wait_s=t1 - t0, train_s=t2 - t1, step_s=now - t0, publish_s=publish_s,
               trainer_tok_s=int(batch.loss_mask.sum()) / (t2 - t1),
               batch_tokens=batch.tokens.numel(),  # rows x padded width: what a padded update computes over
               batch_seq_tokens=int((batch.prompt_lens + batch.comp_lens).sum()),  # the rows' own tokens (MFU's count)
               gen_tok_s=(gen_tok - gen_prev[0]) / (now - gen_prev[1]), buffer_fill=len(buffer),
               staleness_hist={str(s): stale.count(s) for s in sorted(set(stale))},
               staleness_mean=sum(stale) / len(stale), multi_version_frac=multi_version,
               prompts_started=int(control.t[Control.STARTED]), dropped_stale=buffer.n_dropped_stale,
               dropped_filtered=buffer.n_filtered,
               gen_sync_s=stats_of[:, Control.SYNC_S].sum().item(), gen_syncs=stats_of[:, Control.SYNCS].sum().item(),
               reward_errors=stats_of[:, Control.REWARD_ERRORS].sum().item(),
               **{f: stats_of[:, Control.STAT_FIELDS.index(f)].sum().item()  # a reward's reasons (Scored), so far
                  for f in ("reward_timeouts", "reward_crashes", "reward_refused")},
               comp_len_mean=batch.comp_lens.float().mean().item(), comp_len_max=int(batch.comp_lens.max()),
               gen_interrupts=stats_of[:, Control.INTERRUPTS].sum().item(),
               gen_preemptions=stats_of[:, Control.PREEMPTIONS].sum().item(),
               gen_reprefill_tokens=stats_of[:, Control.REPREFILL_TOKENS].sum().item(),
               kv_occupancy=stats_of[:, Control.KV_OCCUPANCY].mean().item())
    if torch.cuda.is_initialized():  # peaks of the caching allocator: the memory plan's lines, measured
        row["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30  # this trainer rank's device
        row["gen_cuda_peak_gib"] = stats_of[:, Control.CUDA_PEAK_BYTES].max().item() / 2**30  # the largest generator's
    return row, (gen_tok, now)


def step_line(row: dict, eta_moved: bool) -> dict:
    """The console step line's fields (common/contracts/progress.py) of a `step_row`: reward, loss and version,
    and, only where they say something, the generators' preemptions and re-prefilled tokens so far
    (non-zero: the KV pool ran short) and eta (`auto` has moved it: `StalenessBound.moved`)."""
    out = {"reward": row["reward_mean"], "loss": row.get("loss", float("nan")), "v": row["version"]}
    for key, name in (("gen_preemptions", "preempted"), ("gen_reprefill_tokens", "reprefill")):
        if row.get(key):
            out[name] = int(row[key])
    if eta_moved and "eta" in row:
        out["eta"] = row["eta"]
    return out
