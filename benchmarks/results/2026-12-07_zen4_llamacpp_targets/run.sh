#!/bin/sh
# 2-core Zen 4 shared with the test suite and other jobs: both engines niced alike, alternating, fresh processes.
set -e
D=benchmarks/results/2026-12-07_zen4_llamacpp_targets
COMMON="--rounds 2 --iters 2 --warmup 1 --decode-in 128 --decode-out 32 --prefill-len 512 --n-ctx 1024"
for F in Q4_0 Q4_K_M; do
  nice -n 15 .venv/bin/python benchmarks/llamacpp_targets.py --shape 1b --ftype $F $COMMON \
      --json $D/1b_$(echo $F | tr A-Z a-z).json 2>&1 | tee -a $D/run.log
done
