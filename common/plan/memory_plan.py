"""A run's memory per device before anything loads (`--print-memory`, and the check every run makes):
each process's weights, gradients, AdamW state, activations, KV pool and allowances, from the models'
config.json alone, against the device's memory (CUDA: its total; CPU: the machine's RAM), written into a ledger
(common/plan/memory_ledger.py); what to change where it does not fit is common/plan/memory_fixes.py's.

Runs in the launching process (common/plan/preflight.py). The arithmetic, per parameter P and token:
  trainer rank   fp32 weights 4P/N + fp32 grads 4P/N + AdamW moments 8P/N (N = train.trainer_devices,
                 FSDP2 shards), the weight store's two copies 2 x P x (2 bf16 | 4 fp32) on rank 0,
                 autocast's bf16 weight copies 2P in bf16; with LoRA (train.lora.rank r) the frozen base
                 P x (2 | 4) and 16 B per adapter parameter (r x (in + out) per targeted projection
                 and layer), the store's two fp32 copies of the adapters; activations of one micro-batch of
                 T = train.micro_batch_tokens tokens (measured on the CPU, tests/test_memory_plan.py):
                 saved per token and layer (5 - parallel_residual) x D + 2 x I + (H + 2 Hkv) x hd
                 values (fp32; in bf16 the norms' inputs stay fp32, the rest halves), plus 2 x D per
                 token outside the layers; with checkpointing, D per layer (the block input) plus one
                 layer recomputed; the head's logits, 2 x min(T x V x 4, 512 MiB) (head.py's chunks)
  generator      policy (and reference, with gen.ref_logp) weights in bf16 on CUDA, fp32 or bf16 on
                 CPU (LoRA: no reference copy, the base's targeted weights kept instead); the paged KV pool, 2 x L x Hkv x hd x (2 | 4) bytes a token, gen.kv_tokens or
                 kv/budget.py's default (CPU: what static slots hold; CUDA: half the free memory when it
                 starts); prefill activations of gen.prefill_tokens; decode logits (and on CUDA the
                 graphs' pool: 3 x max_batch x V x 4 + 256 MiB, an allowance)
  others         reward models, victims, classifiers (and red-teaming's frozen attacker): weights on their
                 section's device, once per reward worker and once for the trainer's evaluation, as the
                 task's config says (`reward_worker_models`, `evaluation_models`); a victim's sampler
                 with its KV pool, prefill activations and logits
A CUDA process also gets a 0.5 GiB context allowance. Prompts are taken as <= 512 tokens.
"""
from __future__ import annotations

import math
import os

from common.engine.kv.budget import KV_FRACTION, PAGE_SIZE, kv_bytes_per_token, static_kv_tokens
from common.engine.kv.pages import sample_kv_tokens
from common.plan.memory_ledger import Plan, Sizes, gb, share
from common.engine.model.lora import target_names
from common.engine.model.model_config import ModelConfig
from common.engine.sampler.sampler import PREFILL_TOKENS

GiB = 2**30
CONTEXT = GiB // 2            # a CUDA context (allowance)
GRAPH_POOL = 256 * 2**20      # CUDA graphs beyond their largest bucket (allowance)
LOGIT_BUDGET = 512 * 2**20    # common/engine/model/head.py: LOGIT_BUDGET_BYTES
PROMPT_TOKENS = 512           # prompt length the plan assumes (data are not read before loading)
TOLERANCE = 0.15              # a measured peak within this of the plan passes (bench/memory_plan.py, bench/paper_runs.py);
                              # a suggested share keeps this margin above the plan


def layer_values(m: ModelConfig) -> tuple[int, int]:
    """(values saved for backward per token and layer, of which fp32: the norms' inputs and stats)."""
    norm_inputs = 1 if m.parallel_residual else 2
    stats = 2 * (1 if m.norm == "rms" else 2) + m.num_attention_heads  # rstd (and mean) per norm, attention's lse
    attn = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    vals = (5 - (1 if m.parallel_residual else 0)) * m.hidden_size + 2 * m.intermediate_size + attn + stats
    return vals, norm_inputs * m.hidden_size + stats


def activation_bytes(m: ModelConfig, tokens: int, checkpointing: bool, half: bool) -> int:
    """Bytes the trainer holds for backward at `tokens` tokens, the head's chunk excluded: per layer
    `layer_values`, outside the layers the embedding's output and the final norm's input (2 x D)
    and RoPE's cos and sin (2 x rotary dims); with checkpointing the block inputs (D per layer) and
    one layer recomputed in backward."""
    vals, fp32 = layer_values(m)
    per_layer = fp32 * 4 + (vals - fp32) * (2 if half else 4)
    outside = (2 * m.hidden_size + (2 * m.rotary_dim if m.positions == "rope" else 0)) * 4
    if checkpointing:
        return tokens * (m.num_hidden_layers * m.hidden_size * 4 + per_layer + outside)
    return tokens * (m.num_hidden_layers * per_layer + outside)


def head_bytes(m: ModelConfig, tokens: int) -> int:
    return 2 * min(tokens * m.vocab_size * 4, LOGIT_BUDGET)


def lora_params(m: ModelConfig, lora) -> tuple[int, int]:
    """(the adapters' parameters, the targeted projections' weights) of LoRA config `lora` on a model
    of config `m`: per layer and targeted projection (in, out), r x (in + out) and in x out."""
    D, I, hd = m.hidden_size, m.intermediate_size, m.head_dim
    shapes = {"q_proj": (D, m.num_attention_heads * hd), "k_proj": (D, m.num_key_value_heads * hd),
              "v_proj": (D, m.num_key_value_heads * hd), "o_proj": (m.num_attention_heads * hd, D),
              "gate_proj": (D, I) if m.gated_mlp else (0, 0), "up_proj": (D, I), "down_proj": (I, D)}
    chosen = [shapes[n] for n in target_names(lora.targets)]
    L = m.num_hidden_layers
    return (L * sum(lora.rank * (a + b) for a, b in chosen if a), L * sum(a * b for a, b in chosen))


def trainer_state(P: int, half: bool, N: int = 1, r: int = 0, lora_rank: int = 0, Pa: int = 0) -> list[tuple[str, float]]:
    """(what, bytes) of trainer rank r of N's weights, gradients, optimizer state and weight store: full
    fine-tuning's, or (lora_rank > 0) the frozen base in the compute dtype and Pa adapter parameters
    trained in fp32 (module docstring)."""
    if lora_rank:
        return [(f"frozen base in {'bf16' if half else 'fp32'}: {P / 1e9:.3f}B params", P * (2 if half else 4)),
                (f"LoRA adapters (rank {lora_rank}), grads, AdamW moments: 16 B x {Pa / 1e6:.2f}M params", 16 * Pa),
                ("weight store: 2 copies of the adapters in fp32", 2 * 4 * Pa)]
    out = [(f"fp32 weights, grads, AdamW moments: 16 B x {P / 1e9:.3f}B params" + (f" / {N}" if N > 1 else ""), 16 * P / N)]
    if r == 0:
        out.append((f"weight store: 2 copies in {'bf16' if half else 'fp32'}", 2 * P * (2 if half else 4)))
    if half:
        out.append(("autocast's bf16 copies of the weights", 2 * P / N))
    return out


def half_precision(cfg) -> bool:
    """bf16 compute: asked for, or `auto` on CUDA (on a CPU `auto` is measured at start: planned as fp32)."""
    return cfg.precision.dtype == "bf16" or (cfg.precision.dtype == "auto" and cfg.train.device.startswith("cuda"))


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(cfg, policy: dict, ref: dict, others: dict, gpus: list | None = None, param_count=None) -> Plan:
    """The plan of a run config `cfg` whose policy, reference and other models have these
    config.json dicts. `gpus`: the GPUs' memory in bytes (CUDA runs; None = unknown), `param_count`:
    fn(config dict) -> parameters (common/engine/checkpoints/shapes.py's)."""
    t, g = cfg.train, cfg.gen
    cuda = t.device.startswith("cuda")
    mp = ModelConfig.from_hf(policy)
    P, Pr = param_count(policy), param_count(ref)
    p = Plan()
    if cuda:
        n_gpu = len(gpus) if gpus else 1
        p.capacity = {f"cuda:{i}": (gpus[i] if gpus else None) for i in range(n_gpu)}
    else:
        n_gpu, p.capacity = 0, {"cpu": ram_bytes()}
    N = t.trainer_devices
    half = half_precision(cfg)
    T = t.micro_batch_tokens
    lora = t.lora.rank > 0  # an adapter read from a folder (train.lora.init): planned as fresh ones of that rank
    Pa, Pt = lora_params(mp, t.lora) if lora else (0, 0)
    for r in range(N):
        d = f"cuda:{r % n_gpu}" if cuda else "cpu"
        who = f"trainer rank {r}" if N > 1 else "trainer"
        for what, nbytes in trainer_state(P, half, N, r, t.lora.rank if lora else 0, Pa):
            p.add(d, who, what, nbytes)
        ck = "checkpointed" if t.activation_checkpointing else "no checkpointing"
        p.add(d, who, f"activations, {T:,} tokens a micro-batch, {ck}", activation_bytes(mp, T, t.activation_checkpointing, half))
        if r == 0:  # the other setting beside it
            other = not t.activation_checkpointing
            p.notes.append(f"{who}: activations {gb(activation_bytes(mp, T, other, half))} "
                           f"{'with' if other else 'without'} checkpointing (--train.activation_checkpointing={str(other).lower()})")
        p.add(d, who, "head: one chunk of logits and its backward", head_bytes(mp, T))
        if cuda:
            p.add(d, who, "CUDA context (allowance)", CONTEXT)
            if t.memory_fraction > 0 and p.capacity[d] is not None:
                p.caps[(d, who)] = t.memory_fraction * p.capacity[d]
    n_gen = t.n_generators or max(1, n_gpu - N)
    wb = 2 if half else 4
    kvb = 2 if cfg.precision.kv == "bf16" or (cfg.precision.kv == "auto" and cuda and half) else 4
    seq = PROMPT_TOKENS + g.max_new_tokens
    page = g.kv_page_size or PAGE_SIZE["cuda" if cuda else "cpu"]
    per = kv_bytes_per_token(mp, kvb)  # a KV pool token's bytes
    ref_held = g.ref_logp and cfg.algo != "areal" and not (lora and cfg.ref_model in (None, cfg.model))
    for r in range(n_gen):
        d = f"cuda:{(N + r) % n_gpu}" if cuda else "cpu"
        who = f"generator {r}"
        p.add(d, who, f"policy weights in {'bf16' if wb == 2 else 'fp32'}", wb * P)
        if ref_held:
            p.add(d, who, "reference weights (gen.ref_logp)", wb * Pr)
        if lora:  # the base's targeted weights kept to fold each publish into (and the reference, swapped in)
            p.add(d, who, "LoRA: the base's targeted weights, kept", wb * Pt)
        p.add(d, who, f"prefill activations, {g.prefill_tokens:,} tokens", g.prefill_tokens * (layer_values(mp)[0]) * wb)
        logits = g.max_batch * mp.vocab_size * 4
        p.add(d, who, "decode logits" + (" and CUDA graphs' pool (allowance)" if cuda else ""),
              3 * logits + GRAPH_POOL if cuda else 2 * logits)
        if cuda:
            p.add(d, who, "CUDA context (allowance)", CONTEXT)
            if g.memory_fraction > 0 and p.capacity[d] is not None:
                p.caps[(d, who)] = g.memory_fraction * p.capacity[d]
    _others(p, cfg, others, ref, param_count)
    for r in range(n_gen):  # the pool last: on CUDA it takes half of what is free when the generator starts
        d = f"cuda:{(N + r) % n_gpu}" if cuda else "cpu"
        _kv(p, d, f"generator {r}", g, per, seq, page, cuda)
    for (d, who), cap in p.caps.items():  # fits, but closer to its cap than the plan's tolerance
        need, total = p.used(d, who, allocator=True), p.capacity[d]
        if cap >= need > cap / (1 + TOLERANCE) and not who.startswith("generator"):  # a generator's pool fills its share
            key = "train" if who.startswith("trainer") else "gen"
            p.notes.append(f"{who}: planned {gb(need)} of its {gb(cap)} share of {d}, within the plan's {TOLERANCE:.0%} "
                           f"tolerance of it (--{key}.memory_fraction={share(need * (1 + TOLERANCE), total):g} "
                           f"keeps that margin)")
    p.sizes = Sizes(mp, P, n_gpu, per, seq, page)
    return p


def _kv(p: Plan, d, who, g, per: int, seq: int, page: int, cuda: bool) -> None:
    need = sample_kv_tokens(PROMPT_TOKENS, g.max_new_tokens, page)  # one full-length sample: the sampler's own rule
    if g.kv_tokens:
        tokens, how = g.kv_tokens // page * page, "gen.kv_tokens"  # the pool's whole pages, as the sampler takes them
    elif not cuda:
        tokens, how = static_kv_tokens(g.max_batch, seq, PROMPT_TOKENS, page), "what static slots hold"
    elif p.capacity[d] is None:
        p.notes.append(f"{who}: KV pool = half the free memory when it starts; {gb(need * per)} holds one "
                       f"full-length sample, {gb(g.max_batch * seq * per)} all {g.max_batch} rows at full length")
        return
    else:
        free = (p.caps[(d, who)] - p.used(d, who, allocator=True)) if (d, who) in p.caps else p.capacity[d] - p.used(d)
        full = static_kv_tokens(g.max_batch, seq, PROMPT_TOKENS, page)  # kv_budget caps it there, as the runtime does
        tokens = max(page, min(full, max(0, int(free * KV_FRACTION)) // per))
        how = "half the free memory" if tokens < full else "what static slots hold (below half the free memory)"
    p.kv_tokens[who] = tokens
    hint = _share_hint(p, d, who, g, per, seq, page) if cuda and not g.kv_tokens and tokens // seq < g.max_batch else ""
    p.add(d, who, f"KV pool ({how}): {tokens:,} tokens x {per / 1024:.0f} KiB", (tokens // page + 1) * page * per)  # whole pages and the scratch page
    if tokens < need:
        p.errors.append(f"{who}'s KV pool holds {tokens:,} tokens, less than one full-length sample needs ({need:,}: "
                        f"a prompt of <= {PROMPT_TOKENS} + gen.max_new_tokens + 1, in pages of {page})")
        if g.kv_tokens:
            p.fixes.append((f"--gen.kv_tokens={need}", "one full-length sample"))
    else:
        p.notes.append(f"{who}: the KV pool holds {tokens // seq:,} full-length samples ({seq:,} tokens, prompts "
                       f"<= {PROMPT_TOKENS}); gen.max_batch = {g.max_batch} (more rows are preempted, not refused)" + hint)


def _share_hint(p: Plan, d, who, g, per: int, seq: int, page: int) -> str:
    """One GPU shared under fixed shares: the trainer's share beyond its plan plus `TOLERANCE`,
    moved to the generator, and the full-length samples its pool (sized as the runtime sizes it:
    half the free memory of its share) would hold then; "" where that gains nothing."""
    tr = next((k for k in p.caps if k[0] == d and k[1].startswith("trainer")), None)
    if tr is None or (d, who) not in p.caps:
        return ""
    total = p.capacity[d]
    new_t = share(p.used(d, tr[1], allocator=True) * (1 + TOLERANCE), total)
    moved = p.caps[tr] / total - new_t
    if moved < 0.02:
        return ""
    new_g = math.floor(100 * (p.caps[(d, who)] / total + moved)) / 100
    free = new_g * total - p.used(d, who, allocator=True)  # before its pool's line
    tokens = min(static_kv_tokens(g.max_batch, seq, PROMPT_TOKENS, page), int(free * KV_FRACTION) // per)
    return (f"; with --train.memory_fraction={new_t:g} --gen.memory_fraction={new_g:g} (the trainer's plan + "
            f"{TOLERANCE:.0%}) it would hold {tokens // seq:,}")


def _others(p: Plan, cfg, others: dict, ref: dict, param_count) -> None:
    """Reward models, victims, classifiers and the policy's frozen copy beside a victim (`ref_model`),
    on their section's device: each reward worker holds one copy of what `cfg.reward_worker_models()`
    names (None: every other model), the trainer's evaluation one of what `cfg.evaluation_models()`
    names. A victim's sampler adds its KV pool (`victim.max_batch` answers at full length), prefill
    activations and decode logits; reward workers on CUDA their contexts. Sequence classifiers load
    through transformers in their section's `dtype` (fp32 unless bf16), causal LMs through our engine
    (bf16 on CUDA)."""
    workers, evals = cfg.reward_worker_models(), cfg.evaluation_models()  # common/run_config.py: RunConfig's
    n = max(1, cfg.train.reward_workers)
    victim = getattr(cfg, "victim", None)
    for who, keys, copies in (("reward workers", tuple(others) if workers is None else workers, n),
                              ("trainer (eval)", evals, 1)):
        for key in keys:
            hf = ref if key == "ref_model" else others.get(key)  # None: a package or a function, no model
            if hf is None:
                continue
            owner = ("victim" if victim is not None else "") if key == "ref_model" else key.split(".")[0]
            section = getattr(cfg, owner, None) if owner else None
            # where it runs: its section's device; a classifier where the victim runs; else the trainer's
            follows = owner if hasattr(section, "device") else "victim" if hasattr(victim, "device") else ""
            dev = getattr(cfg, follows).device if follows else cfg.train.device
            d = "cuda:0" if str(dev).startswith("cuda") else "cpu"
            p.capacity.setdefault(d, ram_bytes() if d == "cpu" else None)
            classifier = "SequenceClassification" in str(hf.get("architectures"))  # loads in its section's dtype
            nb = 2 if classifier and getattr(section, "dtype", "fp32") == "bf16" else 4 if d == "cpu" or classifier else 2
            name = f"--{key}"
            if key == "ref_model":  # red-teaming's frozen attacker beside the victim, else the initial policy beside
                # the trained one, in its dtype (fp32: the trainer's weights), for the evaluation's KL
                name, nb = ("--ref_model (frozen, beside the victim)", nb) if victim is not None else \
                    ("--ref_model (the KL's initial policy)", 4)
            p.add(d, who, f"{name}: {copies} x {nb} B x {param_count(hf) / 1e9:.3f}B params", copies * nb * param_count(hf),
                  follows)
            if key == "victim.model":
                _victim_sampler(p, d, who, copies, ModelConfig.from_hf(hf), section, nb)
    on_gpu = [x for x in p.lines if x.device == "cuda:0" and x.process == "reward workers"]
    if on_gpu:
        p.add("cuda:0", "reward workers", f"CUDA contexts (allowance): {n} x", n * CONTEXT, on_gpu[0].follows)


def _victim_sampler(p: Plan, d, who, copies: int, m: ModelConfig, v, nb: int) -> None:
    """The victim's sampler (common/rewards/redteam.py): its default KV pool, what `v.max_batch` answers hold
    at full length (on CUDA at most half the free memory: planned at the most), prefill activations
    and decode logits (with CUDA graphs' pool)."""
    page = PAGE_SIZE["cuda" if d.startswith("cuda") else "cpu"]
    tokens = static_kv_tokens(v.max_batch, v.max_prompt_tokens + v.max_new_tokens, v.max_prompt_tokens, page)
    per = kv_bytes_per_token(m, nb)
    p.add(d, who, f"--victim.model's KV pool: {copies} x {tokens:,} tokens x {per / 1024:.0f} KiB",
          copies * (tokens // page + 1) * page * per, "victim")  # whole pages and the scratch page
    prefill = min(PREFILL_TOKENS, v.max_batch * v.max_prompt_tokens) * layer_values(m)[0] * nb
    logits = 3 * v.max_batch * m.vocab_size * 4 + (GRAPH_POOL if d.startswith("cuda") else 0)
    p.add(d, who, "--victim.model's prefill activations and decode logits", copies * (prefill + logits), "victim")
