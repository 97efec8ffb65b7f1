#!/bin/bash
# The "on" arm ran a scratch tokenmill_cpu/malloc.py (not committed): CpuPlatform.set_device called glibc mallopt(M_MMAP_THRESHOLD, 1 GiB) and mallopt(M_TRIM_THRESHOLD, 1 GiB); TOKENMILL_CPU_MALLOC_TUNE=0 skipped it. Measured and removed (docs/benchmarks.md, eighteenth session).
# alternating A/B: malloc tuning on (default) vs off, each followed by a ceiling
cd /work/main
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
out=/tmp/ab; mkdir -p $out
for i in 1 2; do
  for arm in on off; do
    if [ $arm = off ]; then export TOKENMILL_CPU_MALLOC_TUNE=0; else unset TOKENMILL_CPU_MALLOC_TUNE; fi
    TOKENMILL_STEP_LOG=$out/steps_${arm}_$i .venv/bin/tokenmill bench throughput --num-prompts 256 --input-len 128 --output-len 128 --dtype float32 --json $out/tp_${arm}_$i.json > $out/tp_${arm}_$i.log 2>&1
    .venv/bin/python benchmarks/gemm_ceiling.py --dtypes float32 --json $out/ceiling_${arm}_$i.json > $out/ceiling_${arm}_$i.log 2>&1
    echo "$arm $i: $(grep 'Output tokens/s' $out/tp_${arm}_$i.log) | $(tail -1 $out/ceiling_${arm}_$i.log | cut -c1-150)"
  done
done
echo ALLDONE
