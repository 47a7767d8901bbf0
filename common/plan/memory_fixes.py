"""What to change where a memory plan (common/plan/memory_plan.py) does not fit: each change with
what it saves (`fixes`), in order, the least disruptive first (the CPU's KV pool budget,
activation checkpointing, a smaller micro-batch, more trainer ranks, a process's share of its GPU,
reward models in bf16, one reward worker, reward-side models on the CPU), and the first of them
that, applied one after another and each re-planned, make the run fit (`together`).

Runs in the launching process (common/plan/preflight.py), before anything loads.
"""
from __future__ import annotations

from common.contracts.config import parse_overrides
from common.engine.kv.budget import KV_FRACTION
from common.engine.kv.pages import sample_kv_tokens
from common.plan.memory_ledger import Plan, gb, share
from common.engine.model.lora import LoRAConfig
from common.plan.memory_plan import (PROMPT_TOKENS, activation_bytes, half_precision, head_bytes, lora_params,
                                     trainer_state)


def fixes(p: Plan, cfg) -> None:
    """What to change, with what each saves, where plan `p` of run config `cfg` does not fit: into
    `p.fixes`, in order, the least disruptive first. None where nothing is past a memory (a KV pool
    below one sample is an error the plan names its own change for)."""
    if p.excess()[1] == 0:
        return
    t, g = cfg.train, cfg.gen
    m, P, n_gpu, per, seq, page = p.sizes
    cuda = n_gpu > 0
    d0 = "cuda:0" if cuda else "cpu"
    half = half_precision(cfg)
    if not cuda and not g.kv_tokens and p.kv_tokens:  # the CPU's default pool: every slot at full length
        pools = len(p.kv_tokens)
        pool_bytes = sum(x.nbytes for x in p.lines if x.what.startswith("KV pool"))
        free = p.capacity["cpu"] - (p.used("cpu") - pool_bytes)  # what the rest of the plan leaves
        tokens = int(free * KV_FRACTION / pools) // per // page * page  # half of it, as CUDA sizes it
        if tokens >= sample_kv_tokens(PROMPT_TOKENS, g.max_new_tokens, page):
            paged = "--gen.kv_layout=paged " if g.kv_layout == "static" else ""
            p.fixes.append((f"{paged}--gen.kv_tokens={tokens}", f"saves {gb(pool_bytes - pools * tokens * per)}"
                            f" on cpu: a pool of {tokens // seq:,} full-length samples a generator, past which rows wait"))
    act = activation_bytes(m, t.micro_batch_tokens, t.activation_checkpointing, half)
    if not t.activation_checkpointing:
        p.fixes.append(("--train.activation_checkpointing=true",
                        f"saves {gb(act - activation_bytes(m, t.micro_batch_tokens, True, half))} on {d0}"))
    smaller = max(1, t.micro_batch_tokens // 4)
    saved = (act + head_bytes(m, t.micro_batch_tokens) - activation_bytes(m, smaller, t.activation_checkpointing, half)
             - head_bytes(m, smaller))
    p.fixes.append((f"--train.micro_batch_tokens={smaller}", f"saves {gb(saved)} on {d0}"))
    if cuda and n_gpu > 1 and t.trainer_devices < n_gpu:
        k = n_gpu if t.n_generators == 0 else t.trainer_devices + 1
        p.fixes.append((f"--train.trainer_devices={k}", f"FSDP2 shards: saves {gb(16 * P - 16 * P // k)} on {d0}"))
    for (d, who), cap in p.caps.items():  # a process past its share of a GPU that has room
        need, total = p.used(d, who, allocator=True), p.capacity[d]
        if need > cap and p.used(d) <= total:
            key = "train" if who.startswith("trainer") else "gen"
            p.fixes.append((f"--{key}.memory_fraction={share(need, total):g}",
                            f"{gb(need - cap)} more for {who} on {d}"))
    if g.kv_tokens:
        p.fixes.append((f"--gen.kv_tokens={g.kv_tokens // 2}", "half the KV pool"))
    v = getattr(cfg, "victim", None)
    victim_pools = sum(x.nbytes for x in p.lines if x.device == "cuda:0" and x.what.startswith("--victim.model's KV pool"))
    if victim_pools and v.max_batch >= 8:  # the victim's pool holds max_batch answers at full length
        p.fixes.append((f"--victim.max_batch={v.max_batch // 4}", f"saves {gb(victim_pools * 3 / 4)} on cuda:0: the "
                                                                   f"victim decodes fewer answers at once"))
    rm = getattr(cfg, "reward", None)
    fp32_rms = sum(x.nbytes for x in p.lines if x.device == "cuda:0" and x.follows == "reward" and " x 4 B x " in x.what)
    if cuda and fp32_rms and getattr(rm, "dtype", None) == "fp32":  # reward models in bf16: half their bytes
        p.fixes.append(("--reward.dtype=bf16", f"saves {gb(fp32_rms / 2)} on cuda:0"))
    w = cfg.train.reward_workers
    held = p.used("cuda:0", "reward workers") if cuda else 0
    if w > 1 and held:  # each reward worker holds its own copy of every reward-side model
        p.fixes.append(("--train.reward_workers=1", f"saves {gb(held * (w - 1) / w)} on cuda:0: one copy of each "
                                                    f"reward worker's model"))
    evaluation = sum(x.nbytes for x in p.lines if x.device == "cuda:0" and x.process == "trainer (eval)")
    if evaluation and cfg.EVAL_OFF:
        p.fixes.append((cfg.EVAL_OFF, f"saves {gb(evaluation)} on cuda:0: no evaluation during the run, so "
                                      f"the trainer loads none of its models"))
    for key in ("reward", "victim"):  # the reward side's models (reward workers, evaluation's) on the CPU
        if getattr(getattr(cfg, key, None), "device", "cpu").startswith("cuda"):
            moved = sum(x.nbytes for x in p.lines if x.device == "cuda:0" and x.follows == key)
            p.fixes.append((f"--{key}.device=cpu", f"saves {gb(moved)} on cuda:0"))
    # adapters instead of every weight: the trainer's largest saving, named last (it changes what is trained)
    if t.lora.rank == 0 and not t.lora.init:
        Pa = lora_params(m, LoRAConfig(rank=16))[0]
        saved = (sum(b for _, b in trainer_state(P, half)) - sum(b for _, b in trainer_state(P, half, lora_rank=16, Pa=Pa)))
        p.fixes.append(("--train.lora.rank=16", f"LoRA adapters on q and v: saves {gb(saved)} "
                                                f"on {d0} (a frozen base, {Pa / 1e6:.1f}M trained parameters)"))


def together(cfg, p: Plan, replan, rounds: int = 4) -> str:
    """Plan `p`'s changes in its own order, each kept when the re-planned run (`replan(cfg)`: a
    Plan with its fixes) is nearer to fitting, until it fits: a sentence naming those settings and
    what they give ("" when the first change alone fits: the list says so already)."""
    chosen, keys, first = [], set(), p.fixes[0][0] if p.fixes else None
    for _ in range(rounds):
        for setting, _what in p.fixes:
            names = {tok.partition("=")[0] for tok in setting.split()}
            if names & keys:  # a setting already changed is not changed twice (a smaller micro-batch again)
                continue
            changed = parse_overrides(cfg, setting.split())
            nxt = replan(changed)
            if nxt.excess() < p.excess():
                cfg, p, keys = changed, nxt, keys | names
                chosen.append(setting)
                break
        else:
            break
        if p.fits:
            if chosen == [first]:
                return ""
            return f"{'Together, ' + ' '.join(chosen) if len(chosen) > 1 else chosen[0] + ' alone'} fits ({p.summary()})"
    if not chosen:
        return ""
    more = ("a larger GPU, more GPUs (--train.trainer_devices)" if cfg.train.device.startswith("cuda")
            else "more memory")
    return f"With {' '.join(chosen)} it still does not fit ({'; '.join(p.over())}): {more}, or a smaller model"
