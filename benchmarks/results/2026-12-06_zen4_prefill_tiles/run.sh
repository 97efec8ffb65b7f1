#!/usr/bin/env bash
# The tiled prefill attention kernel against the one it replaced (commit 700848c, a worktree at $OLD), alternating,
# through the AVX-512 and the AVX2 builds. Run from the repository root with the project's venv active.
OLD=${OLD:-/tmp/wt_old}
AVX2="ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"
for cap in avx512 avx2; do
  envs=""; [ $cap = avx2 ] && envs=$AVX2
  for round in ${ROUNDS:-1 2}; do
    for arm in before after; do
      pp=""; [ $arm = before ] && pp=$OLD/plugins/cpu
      for args in "--lengths 128x15" "--lengths 2048x1" "--lengths 4096x1" "--lengths 1952x1 --prefix 2048"; do
        echo "== $cap round $round $arm $args"
        env $envs PYTHONPATH=$pp python benchmarks/prefill_attention.py $args --iters 10 | grep -E "prefill"
      done
    done
  done
done
