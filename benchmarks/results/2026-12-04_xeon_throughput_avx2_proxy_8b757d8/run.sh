#!/bin/bash
cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
for i in 1 2 3; do
  TOKENMILL_STEP_LOG=/tmp/final/steps_$i .venv/bin/tokenmill bench throughput --num-prompts 256 --input-len 128 --output-len 128 --dtype float32 --json /tmp/final/tp_$i.json > /tmp/final/tp_$i.log 2>&1
  .venv/bin/python benchmarks/gemm_ceiling.py --dtypes float32 --json /tmp/final/ceiling_$i.json > /tmp/final/ceiling_$i.log 2>&1
  echo "run $i: $(grep -i 'output tok' /tmp/final/tp_$i.log | head -1) | $(tail -1 /tmp/final/ceiling_$i.log | cut -c1-140)"
done
echo ALLDONE
