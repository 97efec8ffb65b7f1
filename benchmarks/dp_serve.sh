#!/usr/bin/env bash
# tokenmill bench serve at concurrency 32 against `tokenmill serve` with --data-parallel-size 1 and 2, one after
# the other on this machine (the same model, flags and prompts). Results: $OUT/serve_dp{1,2}_bf16_c32.json, OUT by
# default benchmarks/results/<date>_<machine>_serve_dp (benchmarks/record_name.sh).
set -euo pipefail
TM=${TM:-.venv/bin/tokenmill}
PORT=${PORT:-8131}
OUT=${OUT:-$("$(dirname "$0")/record_name.sh" serve_dp)}
mkdir -p "$OUT"
# Eager (TOKENMILL_COMPILE=0): compiling every step kind at start-up takes many minutes on a loaded 2-core machine.
export TOKENMILL_COMPILE=${TOKENMILL_COMPILE:-0}
FLAGS=(--dtype bfloat16 --max-num-seqs 32 --kv-cache-memory 1GiB)
for DP in 1 2; do
  "$TM" serve "${FLAGS[@]}" --data-parallel-size "$DP" --port "$PORT" > "/tmp/tm-serve-dp$DP.log" 2>&1 &
  SERVER=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 "$SERVER" || { tail -50 "/tmp/tm-serve-dp$DP.log"; exit 1; }
    sleep 2
  done
  "$TM" bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 96 --max-concurrency 32 \
      --input-len 128 --output-len 64 --disable-tqdm --json "$OUT/serve_dp${DP}_bf16_c32.json"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep '^tokenmill:generation_tokens_total' || true
  kill -TERM "$SERVER"; wait "$SERVER" || true
done
