"""Benchmark: several nodes (common/runtime/nodes/world.py): weights out, trajectories back, over gloo.

Two nodes (a trainer node, a generator node), one process each, in a torchrun world:

  weights  the default model's parameter shapes (SmolLM2-135M, random values), the trainer's fp32
           master weights cast into its `WeightStore` (`pack_s`: the local publish, a cast-copy),
           then `send_weights` to the generator node (`wire_s`: from the version key until the
           receiver's acknowledgement; the receiver receives straight into its store's writing
           slot, so the store write is inside it, zero extra copies), against a raw gloo
           send/recv of the same bytes between the same two processes in the same run
           (`raw_s`, on the control group, nothing else running). Medians of --reps.
  trainer_rows  with the trainer on two nodes (dist.trainer_nodes=2, one rank each), the second
           node's rows of the same parameters, sent to rank 0 and written into its store at a
           publish, against raw gloo of the same bytes (`trainer_rows`).
  traj     a producer thread on the generator node adds --groups groups of 4 GSM8K-shaped
           trajectories (100 prompt + 200 completion tokens) to the node's outbox as fast as it
           can; the real `TrajSender` ships them, the real ingest thread adds them to the
           trainer's buffer. rows/s from the first add to the last row in; per group, the
           latency from its add to its rows landing in the trainer's buffer (p50, p99; both
           nodes' clocks are compared, so latencies are meaningful on one machine only).
  staleness  (--staleness) the toy async AReaL run of tests/nodes_toy.py (tiny random model, eta = 4,
           one generator), the same config on one node and on two (two agents on 127.0.0.1):
           the mean over steps of each run's `staleness_mean`, and the difference. `--step-s` adds
           that much to every trainer step (tests/nodes_toy.py: NODES_TOY_STEP_S), so transport
           delays weigh as against real steps of seconds, not the toy's ~40 ms.

Usage (prints one JSON line, from the trainer node):
  python bench/nodes.py [--dtype bf16] [--reps 5] [--groups 500]   # two agents on 127.0.0.1, one machine
  python bench/nodes.py --staleness [--steps 30] [--step-s 0.5]     # one node vs two, same toy config
  torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT bench/nodes.py --worker ...
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common.contracts.batch import Trajectory  # noqa: E402
from common.engine.checkpoints.tiny_model import build_tiny  # noqa: E402 - the toy run's model (--staleness)
from common.contracts.log import read_metrics  # noqa: E402
from common.runtime.shared.buffer import ReplayBuffer  # noqa: E402
from common.runtime.generator import Control  # noqa: E402
from common.runtime.nodes.trajectories import Ingest, StoreControl, TrajSender  # noqa: E402
from common.runtime.nodes.weights import WeightReceiver, send_weights  # noqa: E402
from common.runtime.nodes.world import Node  # noqa: E402
from common.runtime.ranks.publish import receive_rows, send_rows, shard_rows  # noqa: E402
from common.runtime.train_config import DistConfig  # noqa: E402
from common.runtime.shared.weights import WeightStore  # noqa: E402

P_LEN, C_LEN, N = 100, 200, 4  # a GSM8K-shaped group: prompt, completion tokens, samples


def smollm2_shapes(dtype: torch.dtype) -> dict:
    """SmolLM2-135M's parameters (tied embeddings): 134.5M values."""
    d, f, v, kv, layers = 576, 1536, 49152, 192, 30
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    return {k: (torch.Size(s), dtype) for k, s in shapes.items()}


def _group(gid: int, g: torch.Generator) -> list[Trajectory]:
    return [Trajectory(torch.randint(3, 40000, (P_LEN,), generator=g), torch.randint(3, 40000, (C_LEN,), generator=g),
                       -torch.rand(C_LEN, generator=g), torch.zeros(C_LEN, dtype=torch.long), 0.5, gid, "stop")
            for _ in range(N)]


def weights(node: Node, args, dtype) -> dict:
    shapes = smollm2_shapes(dtype)
    store = WeightStore(shapes)
    nbytes = store.slot_bytes(0).numel()
    raw, pack, wire = [], [], []
    for _ in range(args.reps):  # raw gloo: the same bytes, the same two processes, nothing else running
        dist.barrier(node.control)
        t = time.perf_counter()
        if node.rank == 0:
            dist.send(store.slot_bytes(0), 1, group=node.control)
        else:
            dist.recv(store.slot_bytes(0), 0, group=node.control)
        dist.barrier(node.control)
        raw.append(time.perf_counter() - t)
    if node.rank == 0:
        g = torch.Generator().manual_seed(0)
        master = {k: torch.randn(s, generator=g) for k, (s, _) in shapes.items()}  # fp32, as the trainer's
        for v in range(args.reps):
            t0 = time.perf_counter()
            store.publish(master, v)
            t1 = time.perf_counter()
            send_weights(node, store, v)
            pack.append(t1 - t0)
            wire.append(time.perf_counter() - t1)
        node.store.set("weights/done", "1")
        med = statistics.median
        return {"param_bytes": nbytes, "reps": args.reps, "pack_s": round(med(pack), 4), "wire_s": round(med(wire), 4),
                "publish_s": round(med(pack) + med(wire), 4), "raw_gloo_s": round(med(raw), 4),
                "wire_gb_s": round(nbytes / med(wire) / 1e9, 3), "raw_gloo_gb_s": round(nbytes / med(raw) / 1e9, 3),
                "wire_over_raw": round(med(raw) / med(wire), 3), "publish_over_raw": round(med(raw) / (med(pack) + med(wire)), 3)}
    rec = WeightReceiver(node, store)
    rec.start()
    node.store.wait(["weights/done"], node.timeout)
    rec.stop()
    rec.check()
    return {}


def trainer_rows(node: Node, args, dtype) -> dict:
    """dist.trainer_nodes = 2, one rank each: at a publish the second node's rank sends its rows of
    every parameter (the second half of the fp32 master weights, cast to the store's dtype) to rank
    0, which receives them straight into its store (`send_rows` / `receive_rows`,
    common/runtime/ranks/publish.py; `rows_s`: until the store holds them), against a raw gloo send/recv of
    the same bytes as one message, in the same run."""
    shapes = {k: s for k, (s, _) in smollm2_shapes(dtype).items()}
    g = torch.Generator().manual_seed(2)  # rank 0 draws the same rows, to check what arrived
    mine = [torch.randn(s[0] - shard_rows(s[0], 1, 2), *s[1:], generator=g) for s in shapes.values()]
    n = sum((s[0] - shard_rows(s[0], 1, 2)) * s[1:].numel() for s in shapes.values())
    buf, store = torch.empty(n, dtype=dtype), WeightStore(smollm2_shapes(dtype)) if node.rank == 0 else None
    raw, rows = [], []
    for v in range(args.reps):
        dist.barrier(node.control)
        t = time.perf_counter()
        if node.rank == 1:
            dist.send(buf, 0, group=node.control)
        else:
            dist.recv(buf, 1, group=node.control)
        dist.barrier(node.control)
        raw.append(time.perf_counter() - t)
        t = time.perf_counter()
        if node.rank == 1:
            send_rows(mine, dtype, node.control)
        else:
            slot = store.begin_write(v)
            receive_rows(store, slot, shapes, 1, 2, node.control)
            store.end_write(slot, v)
        dist.barrier(node.control)
        rows.append(time.perf_counter() - t)
    if node.rank == 0:  # every row landed where it belongs, cast as the trainer node's own would be
        for (name, s), t in zip(shapes.items(), mine):
            if not torch.equal(store.rows(1 - store.writing_slot(), name, shard_rows(s[0], 1, 2), len(t)), t.to(dtype)):
                raise AssertionError(f"trainer_rows: {name}'s rows differ from what rank 1 sent")
    med = statistics.median
    return {"bytes": buf.numel() * buf.element_size(), "rows_s": round(med(rows), 4), "raw_gloo_s": round(med(raw), 4),
            "rows_over_raw": round(med(raw) / med(rows), 3)} if node.rank == 0 else {}


def trajectories(node: Node, args) -> dict:
    rows, L = args.groups * N, P_LEN + C_LEN
    if node.rank == 1:
        outbox = ReplayBuffer(max(4096, rows), L)
        stats = torch.zeros(1, len(Control.STAT_FIELDS), dtype=torch.float64)
        sender = TrajSender(node, outbox, stats, DistConfig().ship_every)
        g, t_add = torch.Generator().manual_seed(1), []
        groups = [_group(i, g) for i in range(args.groups)]  # built first: only adding and shipping are timed
        dist.barrier(node.control)
        sender.start()
        for i, grp in enumerate(groups):
            t_add.append(time.time())
            outbox.add(grp)
        node.store.wait(["traj/done"], node.timeout)
        sender.stop()
        sender.check()
        dist.gather_object(t_add, None, dst=0, group=node.control)
        return {}
    buffer = ReplayBuffer(max(4096, rows), L)
    control = StoreControl(node, torch.multiprocessing.get_context("spawn"), 1, None, 1)
    ingest = Ingest(node, buffer, control.t, control.stats, 1)
    ingest.start()
    dist.barrier(node.control)
    seen = []  # (time, rows in the buffer) whenever it changed
    deadline = time.monotonic() + node.timeout.total_seconds()
    while buffer.n_added < rows and time.monotonic() < deadline and ingest.error is None:
        n = buffer.n_added
        if not seen or n != seen[-1][1]:
            seen.append((time.time(), n))
        time.sleep(0.0002)
    seen.append((time.time(), buffer.n_added))
    node.store.set("traj/done", "1")
    got: list = [None, None]
    dist.gather_object(None, got, dst=0, group=node.control)
    ingest.stop()
    if ingest.error is not None:
        raise ingest.error
    t_add = got[1]
    times, counts = np.array([t for t, _ in seen]), np.array([c for _, c in seen])
    landed = times[np.searchsorted(counts, (np.arange(len(t_add)) + 1) * N)]  # first time each group was in
    lat = (landed - np.array(t_add)) * 1e3
    return {"groups": len(t_add), "rows": rows, "rows_per_s": round(rows / (landed[-1] - t_add[0]), 1),
            "latency_ms_p50": round(float(np.percentile(lat, 50)), 2),
            "latency_ms_p99": round(float(np.percentile(lat, 99)), 2), "ship_every_s": DistConfig().ship_every}


def worker(args) -> None:
    dc = DistConfig(timeout=300)
    node = Node(dc, dc)
    try:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        out = {"bench": "nodes", "dtype": args.dtype, "host": socket.gethostname(),
               "weights": weights(node, args, dtype), "trainer_rows": trainer_rows(node, args, dtype),
               "traj": trajectories(node, args)}
        if node.rank == 0:
            print(json.dumps(out), flush=True)
    finally:
        node.close()


def _agents(argv: list[str], env: dict) -> list[str]:
    """Two torchrun agents on 127.0.0.1 running argv; their stdouts (exits if one failed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1", *argv]
    # both agents on this machine: one per-run secret for their store values (common/runtime/wire.py)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "ASYNCRL_RUN_SECRET": os.environ.get("ASYNCRL_RUN_SECRET") or secrets.token_hex(32), **env}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        sys.exit("bench/nodes.py: a node failed (its output is above)")
    return outs


def staleness(args) -> None:
    """One node vs two on the toy async AReaL config (module docstring)."""
    root = Path(tempfile.mkdtemp(prefix="bench_nodes_"))
    build_tiny(root / "model", vocab_size=97, hidden_size=32, intermediate_size=64, head_dim=8)  # the toy task's ids
    toy = os.path.join(ROOT, "tests", "nodes_toy.py")
    argv = [f"--model={root / 'model'}", "--algo=areal", f"--train.steps={args.steps}"]
    env = {"PYTHONPATH": ROOT, "NODES_TOY_STEP_S": str(args.step_s)}
    subprocess.run([sys.executable, toy, f"--run_root={root / 'one'}", *argv], env={**os.environ, **env}, check=True,
                   stdout=subprocess.DEVNULL)
    _agents([toy, "--dist.trainer_nodes=1", f"--run_root={root / 'two'}", *argv], env)
    mean, publish = {}, {}
    for k in ("one", "two"):
        rows = [r for r in read_metrics(root / k / "toy" / "metrics.jsonl") if "staleness_mean" in r]
        mean[k] = sum(r["staleness_mean"] for r in rows) / len(rows)
        pub = [r["publish_s"] for r in rows if r.get("publish_s")]  # the trainer's whole publish, as it waits for it
        publish[k] = 1e3 * statistics.median(pub) if pub else float("nan")
    print(json.dumps({"bench": "nodes_staleness", "config": "tests/nodes_toy.py --algo=areal (eta 4, 1 generator)",
                      "steps": args.steps, "step_s_added": args.step_s, "staleness_mean_one_node": round(mean["one"], 3),
                      "staleness_mean_two_nodes": round(mean["two"], 3),
                      "difference": round(mean["two"] - mean["one"], 3),
                      "publish_ms_p50_one_node": round(publish["one"], 2),
                      "publish_ms_p50_two_nodes": round(publish["two"], 2)}))
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="run as one node (under torchrun)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="the weight store's dtype")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=500, help="trajectory groups of 4 to ship")
    ap.add_argument("--staleness", action="store_true", help="one node vs two: mean staleness of the toy AReaL run")
    ap.add_argument("--steps", type=int, default=30, help="--staleness: trainer steps of each run")
    ap.add_argument("--step-s", type=float, default=0.0,
                    help="--staleness: seconds added to each trainer step (the toy's are ~40 ms; real ones take seconds)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        return worker(args)
    if args.staleness:
        return staleness(args)
    outs = _agents([os.path.abspath(__file__), "--worker", f"--dtype={args.dtype}", f"--reps={args.reps}",
                    f"--groups={args.groups}"], {})  # one machine: two agents on the loopback
    line = [ln for o in outs for ln in o.splitlines() if ln.startswith('{"bench"')]
    if not line:
        sys.exit("bench/nodes.py: no result line (the nodes' output is above)")
    print(line[0])


if __name__ == "__main__":
    main()
