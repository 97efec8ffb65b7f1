#!/bin/bash
cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
out=/tmp/kv; mkdir -p $out
for i in 1 2; do
  for kv in bfloat16 auto; do
    TOKENMILL_STEP_LOG=$out/steps_${kv}_$i .venv/bin/tokenmill bench throughput --num-prompts 256 --input-len 128 --output-len 128 --dtype float32 --kv-cache-dtype $kv --json $out/tp_${kv}_$i.json > $out/tp_${kv}_$i.log 2>&1
    .venv/bin/python benchmarks/gemm_ceiling.py --dtypes float32 --json $out/ceiling_${kv}_$i.json > $out/ceiling_${kv}_$i.log 2>&1
    echo "$kv $i: $(grep 'Output tokens/s' $out/tp_${kv}_$i.log) | $(tail -1 $out/ceiling_${kv}_$i.log | cut -c1-150)"
  done
done
echo ALLDONE
