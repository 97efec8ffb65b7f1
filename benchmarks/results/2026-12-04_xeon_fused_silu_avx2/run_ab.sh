#!/bin/bash
# fused (1) vs unfused (0) with the cache key fix; each arm has its own compile cache directory
cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
OUT=/tmp/ab2; mkdir -p $OUT
for spec in "1 a" "0 a" "0 b" "1 b" "1 c" "0 c"; do
  set -- $spec; fused=$1; tag=$2
  TOKENMILL_CACHE_DIR=/tmp/ab2/cache_$fused TOKENMILL_CPU_FUSED_SILU=$fused TOKENMILL_STEP_LOG=$OUT/steps_${fused}_$tag .venv/bin/tokenmill bench throughput --num-prompts 256 --input-len 128 --output-len 128 --dtype float32 --json $OUT/tp_${fused}_$tag.json > $OUT/tp_${fused}_$tag.log 2>&1
  echo "fused=$fused $tag $(grep -i 'output tok' $OUT/tp_${fused}_$tag.log | head -1)"
done
.venv/bin/python benchmarks/gemm_ceiling.py --dtypes float32 --json $OUT/ceiling.json > $OUT/ceiling.log 2>&1
tail -1 $OUT/ceiling.log
echo ALLDONE
