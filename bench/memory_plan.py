"""The memory plan (common/plan/memory_plan.py) against measured peaks: a preset's policy as a random
model of its published shape (`--random_weights`), one trainer step at the preset's micro-batch and one
sampler call at its batch and KV pool, each part in a fresh process, beside the plan's lines for it.

Trainer: the policy in fp32 master weights at the run's precision (bf16 autocast on CUDA), the weight
store, AdamW, and two steps of two micro-batches of `train.micro_batch_tokens` tokens each (rows of
512 + `gen.max_new_tokens` tokens, every position a target), each step published to the store: the
second step's second micro-batch holds weights, AdamW's moments, gradients and activations at once. Generator:
the policy (and the reference, where the run holds one) at the generator's dtype, a Sampler at
`gen.max_batch` rows with the plan's KV pool and the run's prefill budget, one call of `gen.max_batch`
512-token prompts decoding `--decode-tokens` tokens (CUDA graphs as the run takes them). Peak: CUDA's
`max_memory_allocated` (the context, outside the allocator, is left out of the plan's side too); on a
CPU the resident set's growth at a few points of the part (a backward's transient peak is missed; the
allocator may keep or return pages), a rough check only. Prints one JSON line: per part the
planned and measured bytes and their ratio, `within` 15%.

    python bench/memory_plan.py --task gsm8k --preset paper                 # on a GPU: TBA's GSM8K shapes
    python bench/memory_plan.py --task tldr --preset paper --only trainer   # one part
    python bench/memory_plan.py --task gsm8k --model /path/to/dir --set train.micro_batch_tokens=2048  # small, CPU
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.host_memory import rss_bytes  # noqa: E402
from common.plan import preflight  # noqa: E402
from common.plan.memory_plan import CONTEXT, PROMPT_TOKENS, TOLERANCE  # noqa: E402
from common.engine.machine.precision import resolve  # noqa: E402
from common.engine.sampler.sampler import Sampler  # noqa: E402
from common.engine.sampler.sampling import SamplingParams  # noqa: E402
from common.contracts.ops import token_logp  # noqa: E402
from common.runtime.step import make_optimizer  # noqa: E402
from common.runtime.shared.weights import WeightStore  # noqa: E402

PARTS = ("trainer", "generator")


def config(a):
    """The run config of the task and preset, its hub models replaced by random ones (built once)."""
    argv = [f"--preset={a.preset}", "--memory_check=false"] + ([f"--model={a.model}"] if a.model else [])
    argv += [f"--{kv}" for kv in a.set]
    cfg = importlib.import_module(f"run_{a.task}").make_config(argv)
    preflight.use_random_weights(cfg)
    return cfg


class Meter:
    """A part's peak: CUDA's max_memory_allocated; on a CPU the largest resident-set growth over the
    samples taken (after loading, with the activations alive, after the step), read from /proc."""

    def __init__(self, dev):
        self.dev, self.samples = dev, []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self.start = torch.cuda.memory_allocated(dev)
        else:
            self.start = rss_bytes()

    def sample(self):
        if self.dev.type != "cuda":
            self.samples.append(rss_bytes() - self.start)

    def peak(self) -> int:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            return torch.cuda.max_memory_allocated(self.dev)
        self.sample()
        return max(self.samples)


def trainer_part(cfg, dev) -> int:
    prec = resolve(cfg.precision, str(dev))  # before the meter: a CPU's first resolve times GEMMs
    m = Meter(dev)
    model, _ = prec.load(cfg.model, device=dev, role="trainer", tokenizer=False)
    model.train()
    model.checkpoint_layers = cfg.train.activation_checkpointing
    store = WeightStore.from_module(model, device=dev, dtype=prec.torch_dtype)
    opt = make_optimizer(model, cfg.train.lr, cfg.train.weight_decay)
    length = min(PROMPT_TOKENS + cfg.gen.max_new_tokens, model.cfg.max_position_embeddings)
    rows = max(1, cfg.train.micro_batch_tokens // length)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.cfg.vocab_size, (rows, length), generator=g).to(dev)
    for step in range(2):  # as step.py: grads set to None, two micro-batches accumulated, the update, a publish
        opt.zero_grad(set_to_none=True)  # the second step's second micro-batch holds everything the plan sums
        for _ in range(2):
            loss = token_logp(model, tokens, cfg.gen.temperature).sum()  # every position a target, as the plan's head
            m.sample()  # the activations alive
            loss.backward()
        opt.step()
        store.publish(model, step + 1)
        m.sample()
    return m.peak()


def generator_part(cfg, dev, kv_tokens: int, decode_tokens: int) -> int:
    prec = resolve(cfg.precision, str(dev))
    m = Meter(dev)
    model, _ = prec.load(cfg.model, device=dev, role="generator", tokenizer=False)
    if cfg.gen.ref_logp and cfg.algo != "areal":
        prec.load(cfg.ref_model or cfg.model, device=dev, role="generator", tokenizer=False)  # held, as a generator does
    seq = min(PROMPT_TOKENS + cfg.gen.max_new_tokens, model.cfg.max_position_embeddings)
    s = Sampler(model, max_batch=cfg.gen.max_batch, max_seq_len=seq, max_prompt_len=min(PROMPT_TOKENS, seq - 1),
                prefill_tokens=cfg.gen.prefill_tokens, kv_tokens=kv_tokens, cuda_graphs=cfg.gen.cuda_graphs)
    m.sample()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.cfg.vocab_size, (cfg.gen.max_batch, min(PROMPT_TOKENS, seq - 1)), generator=g)
    s.generate(prompts.tolist(), SamplingParams(max_new_tokens=decode_tokens, temperature=1.0, seed=0))
    return m.peak()


def run_part(a) -> dict:
    cfg = config(a)
    dev = torch.device("cuda:0" if cfg.train.device.startswith("cuda") else "cpu")
    cfg.train.trainer_devices, cfg.train.n_generators = 1, 1
    plan = preflight.plan_of(cfg)
    t = time.perf_counter()
    if a.part == "trainer":
        got, who = trainer_part(cfg, dev), "trainer"
    else:
        who = "generator 0"
        got = generator_part(cfg, dev, plan.kv_tokens.get(who) or cfg.gen.kv_tokens or 0, a.decode_tokens)
    want = plan.used(str(dev), who, allocator=True)  # the CUDA context allowance left out: the allocator does not see it
    return {"part": a.part, "planned": want, "measured": got, "ratio": round(got / max(want, 1), 4),
            "within": abs(got / max(want, 1) - 1) <= TOLERANCE, "seconds": round(time.perf_counter() - t, 1),
            "peak": "max_memory_allocated" if dev.type == "cuda" else "resident set growth, sampled (rough)", "model": cfg.model}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="gsm8k", choices=("gsm8k", "tldr", "redteam"))
    ap.add_argument("--preset", default="paper")
    ap.add_argument("--model", default=None, help="instead of the preset's policy (a local dir or a hub id in SHAPES)")
    ap.add_argument("--set", action="append", default=[], help="a config override, key=value (repeatable)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    ap.add_argument("--decode-tokens", type=int, default=16, help="tokens each sample decodes in the generator part")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one part, in this process
    a = ap.parse_args(argv)
    if a.part:
        out = run_part(a)
        print(json.dumps(out))
        return out
    config(a)  # build the random models once, before the parts' processes
    res = {"bench": "memory_plan", "task": a.task, "preset": a.preset, "tolerance": TOLERANCE,
           "context_allowance": CONTEXT, "date": time.strftime("%Y-%m-%d")}
    for part in a.only.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--task", a.task, "--preset", a.preset,
               "--decode-tokens", str(a.decode_tokens)] + (["--model", a.model] if a.model else [])
        cmd += [x for kv in a.set for x in ("--set", kv)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            res[part] = {"error": r.stderr[-3000:]}
            continue
        res[part] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"[memory_plan] {part}: planned {res[part]['planned'] / 1e9:.2f} GB, measured "
              f"{res[part]['measured'] / 1e9:.2f} GB ({res[part]['ratio']:.2f}x)", file=sys.stderr)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
