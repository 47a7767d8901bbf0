#!/usr/bin/env bash
# Re-measure BENCHMARKS.md's CPU headline rows on this machine, one after another, each command's
# JSON lines kept in bench/results/<row>-<date>-<cpu>.json (stdout only; its stderr, progress and
# tables, in the same name with .log). A row whose file exists is skipped, so a run cut short goes
# on where it stopped. Nothing else should run on the machine meanwhile: these are timings.
#
#   bash bench/cpu_headlines.sh                 # every row (about four hours on 2 cores)
#   ROWS="weights trainer_floor" bash bench/cpu_headlines.sh
#
# The GPU rows are bench/gpu_check.sh's; the faults row is `python bench/faults.py` (here too).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
DATE=${DATE:-$(date +%F)}
CPU=$(python -c "from bench.command_run import cpu_kind; print(cpu_kind())")
OUT=bench/results
TASK="python bench/command_run.py"
declare -A CMD=(
  [sampler_auto]="python bench/sampler.py --vs-fp32"
  [sampler_fp32]="python bench/sampler.py --prompts 8 --n 4 --max-new 128 --skip-hf-bf16"
  [sampler_fp32_pythia]="python bench/sampler.py --arch pythia-160m --prompts 8 --n 4 --max-new 128 --skip-hf-bf16"
  [measure_decode]="python -m common.runtime.measure_decode"
  [trainer_floor]="python bench/trainer_floor.py --no-profile --reps 3"
  [trainer_floor_group4]="python bench/trainer_floor.py --group 4 --no-profile --reps 3"
  [trainer_floor_rows8]="python bench/trainer_floor.py --rows 8 --tokens 200 --reps 2 --no-profile"
  [trainer_step_auto]="python bench/trainer_step.py"
  [trainer_ranks]="python bench/trainer_step.py --ranks 1,2"
  [weights]="python bench/weights.py --reps 5"
  [nodes]="python bench/nodes.py --reps 3 --groups 300"
  [record_replay]="python bench/record_replay.py --pairs 4 --reps 1 --steps 5 --warmup 1 --max-new 32"
  [async_tba]="python bench/async_speedup.py --dtype=fp32"
  [async_areal]="python bench/async_speedup.py --algo=areal"
  [staleness_ablation]="python bench/staleness.py"
  [faults]="python bench/faults.py"
  [tiny_run]="$TASK --label quickstart_tiny --run-dir runs/gsm8k_tiny -- python run_gsm8k.py --model=tiny --name=gsm8k_tiny --train.steps=10 --data.eval_size=16 --overwrite"
  [main_job]="$TASK --label main_job --run-dir runs/gsm8k_tba -- python run_gsm8k.py --overwrite"
  [main_job_fp32]="$TASK --label main_job_fp32 --run-dir runs/gsm8k_fp32 -- python run_gsm8k.py --name=gsm8k_fp32 --precision.dtype=fp32 --overwrite"
  [tldr_run]="$TASK --label tldr_default --run-dir runs/tldr_tba -- python run_tldr.py --overwrite"
  [redteam_run]="$TASK --label redteam_default --run-dir runs/redteam_tba -- python run_redteam.py --overwrite"
  [code_run]="$TASK --label code_default --run-dir runs/code_tba -- python run_code.py --overwrite"
  [sandbox]="python bench/sandbox.py --repeat 3"
)
ORDER="weights measure_decode trainer_floor trainer_floor_group4 trainer_floor_rows8 trainer_step_auto trainer_ranks
sampler_auto sampler_fp32 sampler_fp32_pythia nodes record_replay async_tba async_areal staleness_ablation faults
sandbox tiny_run main_job main_job_fp32 tldr_run redteam_run code_run"
for row in ${ROWS:-$ORDER}; do
  f="$OUT/$row-$DATE-$CPU.json"
  [[ -n "${CMD[$row]:-}" ]] || { echo "no row '$row' (rows: $ORDER)" >&2; exit 2; }
  [[ -s "$f" ]] && { echo "[headlines] $row: $f exists, skipped" >&2; continue; }
  echo "[headlines] $row: ${CMD[$row]}" >&2
  start=$(date +%s)
  echo "[headlines] $row at $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (uncommitted changes)'), $(date -Is): ${CMD[$row]}" > "${f%.json}.log"
  if ${CMD[$row]} > "$f.part" 2>> "${f%.json}.log"; then
    grep '^{' "$f.part" > "$f"; rm -f "$f.part"
    echo "[headlines] $row: $(( $(date +%s) - start )) s -> $f" >&2
  else
    echo "[headlines] $row failed after $(( $(date +%s) - start )) s (see ${f%.json}.log)" >&2
  fi
done
