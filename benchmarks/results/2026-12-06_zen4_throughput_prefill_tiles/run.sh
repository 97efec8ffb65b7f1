#!/bin/bash
# Offline throughput (one engine core, float32, AVX2 paths) before (commit 700848c, a worktree at $OLD) and after
# the tiled prefill attention kernel, alternating, each pair followed by the matmul ceiling. Usage, from the
# repository root with tokenmill's venv active:
#   ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PAIRS=2 OLD=/tmp/wt_old ./run.sh OUT_DIR
set -u
OUT=$(realpath -m "$1"); mkdir -p "$OUT"
for i in $(seq 1 "${PAIRS:-2}"); do
  for arm in after before; do
    pp=""; [ $arm = before ] && pp=$OLD/plugins/cpu
    PYTHONPATH=$pp tokenmill bench throughput --num-prompts 256 --input-len 128 --output-len 128 --dtype float32 \
      --json "$OUT/${arm}_$i.json" > "$OUT/${arm}_$i.log" 2>&1
    echo "pair $i $arm: $(grep -h 'Output tokens/s' "$OUT/${arm}_$i.log")"
  done
  python benchmarks/gemm_ceiling.py --dtypes float32 --json "$OUT/ceiling_$i.json" > "$OUT/ceiling_$i.log" 2>&1
  echo "pair $i: $(tail -1 "$OUT/ceiling_$i.log" | grep -o 'ceiling [0-9]* output tok/s')"
done
