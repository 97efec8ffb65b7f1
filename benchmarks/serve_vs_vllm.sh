#!/usr/bin/env bash
# vLLM's CPU build and tokenmill driven by the same client (`vllm bench serve`): random 128 in / 128 out,
# ignore_eos, greedy, a warm-up (seed 100), then RUNS timed runs at concurrency 32 (64 prompts, seeds 1, 2, ...)
# and at concurrency 1 (8 prompts, seeds 11, 12, ...). Distinct seeds keep the prefix caches honest.
#
#   VLLM_VENV=/path/to/vllm-venv MODEL=/path/to/hf-layout-model [DTYPE=float32] [OUT=dir] [SKIP_VLLM=1] \
#   [TAG=tm] [TM_ARGS="..."] [RUNS=2] [INTERLEAVE=1] benchmarks/serve_vs_vllm.sh
#
# Default: the two servers one after the other. INTERLEAVE=1: both servers up at once (idle while the other is
# measured), and the timed runs alternate vLLM, tokenmill, vLLM, ... so that a slow period of a shared machine
# hits both. MODEL must be a Hugging Face layout directory both engines can load. tokenmill is timed only after its
# log says "background compilation done". Results: $OUT/<engine>_<c32|c1>_r<N>.json (vLLM's result format); each
# run's log ends with the CPU time the hypervisor took from this VM meanwhile ("CPU steal"), which marks a run
# slowed by a neighbour.
set -u
OUT=${OUT:-$("$(dirname "$0")/record_name.sh" serve_vs_vllm)}  # <date>_<machine>_serve_vs_vllm
DTYPE=${DTYPE:-float32}
RUNS=${RUNS:-2}
V=${VLLM_VENV:?set VLLM_VENV to the venv holding vLLM CPU}/bin
M=${MODEL:?set MODEL to a Hugging Face layout model directory}
TOKENMILL=${TOKENMILL:-tokenmill}
T=${TAG:-tm}
mkdir -p "$OUT"
steal() { awk '/^cpu /{print $9}' /proc/stat; }  # jiffies (1/100 s) the hypervisor gave this VM's CPUs to others
client() { # port tag concurrency num_prompts seed
  local s0; s0=$(steal)
  "$V/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$1" --model smol --tokenizer "$M" \
    --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts "$4" --max-concurrency "$3" \
    --ignore-eos --temperature 0 --seed "$5" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "$2.json" > "$OUT/$2.log" 2>&1
  printf "\nCPU steal during the run (s): %s\n" "$(( ($(steal) - s0) / 100 ))" >> "$OUT/$2.log"
  grep -E 'Output token throughput|Mean TTFT|P99 TTFT|Median TPOT|P99 TPOT|CPU steal' "$OUT/$2.log" | sed "s/^/$2: /"
}
wait_ready() { # port t0
  for _ in $(seq 1 1200); do
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && { echo "ready after $(( $(date +%s) - $2 )) s"; return 0; }
    sleep 1
  done
  echo "not ready"; return 1
}
start_vllm() {
  t0=$(date +%s)
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1 "$V/vllm" serve "$M" --served-model-name smol \
    --port 8100 --dtype "$DTYPE" > "$OUT/vllm_server.log" 2>&1 &
  VP=$!
  echo "vllm: $(wait_ready 8100 "$t0")"
  client 8100 vllm_warm 32 32 100 >/dev/null
}
start_tm() {
  t0=$(date +%s)
  # shellcheck disable=SC2086
  "$TOKENMILL" serve "$M" --served-model-name smol --port 8200 --dtype "$DTYPE" ${TM_ARGS:-} > "$OUT/${T}_server.log" 2>&1 &
  TP=$!
  echo "tokenmill: $(wait_ready 8200 "$t0")"
  for _ in $(seq 1 900); do grep -q 'background compilation done' "$OUT/${T}_server.log" && break; sleep 1; done
  echo "tokenmill compile done after $(( $(date +%s) - t0 )) s"
  client 8200 "${T}_warm" 32 32 100 >/dev/null
}
stop() { kill "$1"; wait "$1" 2>/dev/null; sleep 3; }
if [ "${INTERLEAVE:-0}" = 1 ]; then
  start_vllm; start_tm
  for r in $(seq 1 "$RUNS"); do client 8100 "vllm_c32_r$r" 32 64 "$r"; client 8200 "${T}_c32_r$r" 32 64 "$r"; done
  for r in $(seq 1 "$RUNS"); do
    client 8100 "vllm_c1_r$r" 1 8 $((r + 10)); client 8200 "${T}_c1_r$r" 1 8 $((r + 10))
  done
  stop "$VP"; stop "$TP"
  exit 0
fi
if [ "${SKIP_VLLM:-0}" != 1 ]; then
  start_vllm
  for r in $(seq 1 "$RUNS"); do client 8100 "vllm_c32_r$r" 32 64 "$r"; done
  for r in $(seq 1 "$RUNS"); do client 8100 "vllm_c1_r$r" 1 8 $((r + 10)); done
  stop "$VP"
fi
start_tm
for r in $(seq 1 "$RUNS"); do client 8200 "${T}_c32_r$r" 32 64 "$r"; done
for r in $(seq 1 "$RUNS"); do client 8200 "${T}_c1_r$r" 1 8 $((r + 10)); done
stop "$TP"
