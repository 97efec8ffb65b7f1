#!/bin/bash
# Offline throughput, one engine core (torch's default threads) against --data-parallel-size 2 (one engine core
# per core), each pair followed by the matmul ceiling. Usage (from anywhere, with tokenmill's venv active):
#   [ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2] PAIRS=3 ./run.sh OUT_DIR
set -u
OUT=$(realpath -m "$1"); mkdir -p "$OUT"
cd "$(dirname "$0")/../../.."
for i in $(seq 1 "${PAIRS:-3}"); do
  for dp in 1 2; do
    tokenmill bench throughput --num-prompts 256 --input-len 128 --output-len 128 --dtype float32 \
      --data-parallel-size $dp --json "$OUT/dp${dp}_$i.json" > "$OUT/dp${dp}_$i.log" 2>&1
    echo "pair $i dp $dp: $(grep -h 'Output tokens/s' "$OUT/dp${dp}_$i.log")"
  done
  python benchmarks/gemm_ceiling.py --dtypes float32 --json "$OUT/ceiling_$i.json" > "$OUT/ceiling_$i.log" 2>&1
  echo "pair $i: $(tail -1 "$OUT/ceiling_$i.log" | grep -o 'ceiling [0-9]* output tok/s')"
done
