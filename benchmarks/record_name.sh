#!/usr/bin/env bash
# Prints the path for a new record under benchmarks/results: <UTC date>_<machine>_<WHAT> (docs/benchmarks.md,
# "JSON results"). MACHINE overrides the machine tag; by default it comes from /proc/cpuinfo: zen2 / zen3 / zen4 /
# zen5 for AMD (CPU family 23, 25 below model 16, 25 from model 16, 26), xeon for an Intel Xeon, else the
# vendor's or the architecture's name.
#
#   benchmarks/record_name.sh serve_vs_vllm     # -> benchmarks/results/2026-12-07_zen4_serve_vs_vllm
set -eu
what=${1:?usage: benchmarks/record_name.sh WHAT}
machine=${MACHINE:-}
if [ -z "$machine" ]; then
  field() { awk -F': ' -v k="$1" '$1 ~ "^"k"[ \t]*$" {print $2; exit}' /proc/cpuinfo 2>/dev/null || true; }
  vendor=$(field vendor_id); family=$(field "cpu family"); model=$(field model); name=$(field "model name")
  case "$vendor:$family" in
    AuthenticAMD:23) machine=zen2 ;;
    AuthenticAMD:25) if [ "${model:-0}" -ge 16 ]; then machine=zen4; else machine=zen3; fi ;;
    AuthenticAMD:26) machine=zen5 ;;
    AuthenticAMD:*) machine=amd ;;
    GenuineIntel:*) case "$name" in *Xeon*) machine=xeon ;; *) machine=intel ;; esac ;;
    *) machine=$(uname -m) ;;
  esac
fi
echo "benchmarks/results/$(date -u +%F)_${machine}_${what}"
