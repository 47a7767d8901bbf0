"""Benchmark: trainer -> generator weight update, `common.runtime.shared.weights.WeightStore` vs a pickled Queue.

Two processes: this one (the trainer: owns the model, publishes) and one spawned generator
(holds its own copy of the model, applies updates, reports floats/timestamps only).

  ours   trainer: `store.publish(model, v)` (timed here); generator: `store.apply_to(model)`
         (timed there, perf_counter), one copy per parameter; and `store.load_into(bound)` into
         a second copy laid out by `store.bind` (what generators do: one copy of the whole slot),
         `ours_apply_bound_s`. ours_total_s = publish + apply (per parameter).
  queue  trainer: clone the state dict, `torch.save` it into bytes, `queue.put(bytes)`;
         generator: `get`, `torch.load`, `load_state_dict`. queue_total_s = generator's
         time.time() when loaded - trainer's time.time() before the clone (same machine clock).

bytes_moved_* count full-size memory copies per update along each path (P = param_bytes,
S = serialised payload): ours 2P (into the shared slot, out of it into the params); queue
2P + 6S (clone, load_state_dict; torch.save, Queue pickle, pipe write, pipe read, unpickle,
torch.load).

Usage: python bench/weights.py [--random] [--model NAME] [--reps 5]   -> prints one JSON line.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

from common.runtime.shared.weights import WeightStore  # noqa: E402


class _Attn(nn.Module):
    def __init__(self, d, dkv):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k_proj, self.v_proj = nn.Linear(d, dkv, bias=False), nn.Linear(d, dkv, bias=False)


class _MLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)


class _Layer(nn.Module):
    def __init__(self, d, dkv, f):
        super().__init__()
        self.self_attn, self.mlp = _Attn(d, dkv), _MLP(d, f)
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))


class RandomSmolLM(nn.Module):
    """SmolLM2-135M parameter shapes only (no forward): enough to move weights around."""

    def __init__(self, vocab=49152, d=576, dkv=192, f=1536, n_layers=30):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Layer(d, dkv, f) for _ in range(n_layers))
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied


def build_model(name: str | None) -> nn.Module:
    if name is None:
        return RandomSmolLM()
    from common.engine.checkpoints.hf_io import load_model
    model = load_model(name)
    return model[0] if isinstance(model, tuple) else model  # load_model -> (model, tokenizer)


def generator(name, store, cmd_q, res_q):
    """Spawned generator: serves 'ours' / 'queue' update requests until 'stop'."""
    torch.set_num_threads(1)
    model = build_model(name).requires_grad_(False)
    bound = build_model(name).requires_grad_(False)
    assert store.bind(bound)
    res_q.put(("ready",))
    while True:
        cmd = cmd_q.get()
        if cmd[0] == "stop":
            return
        if cmd[0] == "ours":
            t = time.perf_counter()
            v = store.apply_to(model)
            t_app = time.perf_counter() - t
            t = time.perf_counter()
            vb = store.load_into(bound)
            res_q.put(("ours", v, t_app, vb, time.perf_counter() - t))
        else:  # "queue": cmd[1] is the torch.save payload
            sd = torch.load(io.BytesIO(cmd[1]), weights_only=True)
            model.load_state_dict(sd)
            res_q.put(("queue", time.time()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M shapes, random weights")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    name = None if args.random else args.model

    model = build_model(name).requires_grad_(False)
    store = WeightStore.from_module(model)
    ctx = mp.get_context("spawn")
    cmd_q, res_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=generator, args=(name, store, cmd_q, res_q), daemon=True)
    proc.start()
    try:
        assert res_q.get(timeout=300)[0] == "ready"
        pub, app, appb, que, payload_len = [], [], [], [], 0
        for rep in range(args.reps + 1):  # rep 0 is the warm-up (page faults, allocator)
            t = time.perf_counter()
            store.publish(model, rep + 1)
            t_pub = time.perf_counter() - t
            cmd_q.put(("ours",))
            tag, v, t_app, vb, t_appb = res_q.get(timeout=300)
            assert tag == "ours" and v == vb == rep + 1, (tag, v, vb)

            t0 = time.time()
            buf = io.BytesIO()
            torch.save({k: t.clone() for k, t in model.state_dict().items()}, buf)
            payload = buf.getvalue()
            payload_len = len(payload)
            cmd_q.put(("queue", payload))
            del buf, payload  # the Queue's feeder thread holds its own reference until sent
            tag, t_loaded = res_q.get(timeout=300)
            if rep:
                pub.append(t_pub), app.append(t_app), appb.append(t_appb), que.append(t_loaded - t0)
        cmd_q.put(("stop",))
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.terminate()

    p = store.nbytes
    med = statistics.median
    ours = med(pub) + med(app)
    print(json.dumps({
        "bench": "weights", "model": "random-SmolLM2-135M-shapes" if args.random else args.model,
        "param_bytes": p, "reps": args.reps,
        "ours_publish_s": round(med(pub), 5), "ours_apply_s": round(med(app), 5),
        "ours_apply_bound_s": round(med(appb), 5), "bound_over_per_param": round(med(appb) / med(app), 3),
        "ours_total_s": round(ours, 5), "queue_total_s": round(med(que), 5),
        "speedup": round(med(que) / ours, 2),
        "bytes_moved_ours": 2 * p, "bytes_moved_queue": 2 * p + 6 * payload_len,
    }))


if __name__ == "__main__":
    main()
