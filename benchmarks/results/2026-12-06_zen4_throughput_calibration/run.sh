#!/bin/bash
# Offline throughput (one engine core) with the large-row measurement as committed (it picks the panel kernel on
# this CPU) against the outcome the old three-product measurement often picked here: F.linear above 256 rows
# (TOKENMILL_CPU_PANEL_MAX_ROWS=256 fixes that bound without measuring). Each pair is followed by the matmul
# ceiling. Usage (from anywhere, with tokenmill's venv active):
#   [ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2] PAIRS=3 ./run.sh OUT_DIR
set -u
OUT=$(realpath -m "$1"); mkdir -p "$OUT"
cd "$(dirname "$0")/../../.."
for i in $(seq 1 "${PAIRS:-3}"); do
  for arm in measured linear_above_256; do
    if [ $arm = measured ]; then unset TOKENMILL_CPU_PANEL_MAX_ROWS; else export TOKENMILL_CPU_PANEL_MAX_ROWS=256; fi
    tokenmill bench throughput --num-prompts 256 --input-len 128 --output-len 128 --dtype float32 \
      --json "$OUT/${arm}_$i.json" > "$OUT/${arm}_$i.log" 2>&1
    echo "pair $i $arm: $(grep -h 'Output tokens/s' "$OUT/${arm}_$i.log")"
  done
  unset TOKENMILL_CPU_PANEL_MAX_ROWS
  python benchmarks/gemm_ceiling.py --dtypes float32 --json "$OUT/ceiling_$i.json" > "$OUT/ceiling_$i.log" 2>&1
  echo "pair $i: $(tail -1 "$OUT/ceiling_$i.log" | grep -o 'ceiling [0-9]* output tok/s')"
done
