#!/usr/bin/env bash
# The start-up and single-stream targets on one machine, one after the other (2026-12-06, Zen 4).
# Run from the repository root with the project's venv active. LLAMA_AVX2 / LLAMA_NATIVE: the lib/ folders of
# llama-cpp-python 0.3.36 built with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
# and with -DGGML_NATIVE=ON.
set -u
D=benchmarks/results/2026-12-06_zen4_targets
AVX2="ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
log "start-up, native level"
python benchmarks/startup.py --warm-runs 3 --output $D/startup_native.json
log "start-up, AVX2 paths"
env $AVX2 python benchmarks/startup.py --warm-runs 3 --cache-dir /tmp/tm-startup-cache-avx2 --output $D/startup_avx2.json
LAT="--input-len 128 --output-len 128 --num-iters 5 --num-iters-warmup 1 --dtype float32 --quantization int4 --baseline llamacpp"
for i in 1 2; do
  log "single stream, AVX2 paths, round $i"
  env $AVX2 LLAMA_CPP_LIB_PATH=$LLAMA_AVX2 tokenmill bench latency $LAT --json $D/latency_avx2_r$i.json
  log "single stream, AVX-512, round $i"
  LLAMA_CPP_LIB_PATH=$LLAMA_NATIVE tokenmill bench latency $LAT --json $D/latency_avx512_r$i.json
done
log "done"
