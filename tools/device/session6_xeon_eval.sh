#!/usr/bin/env bash
# Issue 5's long-context paired task table and the Xeon speed run (session 6).
#   session6_xeon_eval.sh UNITS SECONDS [bench]
# UNITS: lines "CONTEXT TASK SEED", one sample each (tools/device/session6_units.py writes them).
# Every unit is its own `fluxion eval tasks --samples 1` process on one core, $(nproc) at a time,
# in file order, until SECONDS have passed; a unit cut short leaves no JSON and is run again in a
# later call. With `bench`, the one-core attention bench runs first, alone on the machine.
# Everything comes back as one tarball ($OUT holds at most 8 files).
# Bundle: ../shared/device/bundle.sh .device build/fluxion; tar -cJf .device.tar.xz .device;
# carry [".device.tar.xz"].
set -uo pipefail
units=$1
seconds=$2
phase=${3:-eval}
start=$(date +%s)
[ -d .device ] || tar -xJf .device.tar.xz
source .device/env.sh
export FLUXION_SOURCE_DIR=$PWD
out=${OUT:-/tmp/out}
work=/tmp/session6-$(basename "$units" .txt)
mkdir -p "$out" "$work"
lscpu > "$work/lscpu.txt"
echo "nproc $(nproc)"

# OpenBLAS picks its kernels from cpuid; on this VM its default single-core sgemm ran at 14.6
# GFLOP/s in session 1. Time one 4K prefill under each candidate core type and keep the fastest.
best=""
best_ms=999999
for core in default COOPERLAKE SKYLAKEX HASWELL; do
  ms=$( ( [ "$core" = default ] || export OPENBLAS_CORETYPE=$core
          fluxion eval tasks --model models/fluxion-tiny-retrieval --tasks niah_single \
            --contexts 4096 --samples 1 --policy full --threads 1 --max-new-tokens 1 2>&1 ) |
        sed -n 's/.*(prefill \([0-9]*\) ms).*/\1/p')
  echo "openblas core $core: 4K prefill ${ms:-failed} ms" | tee -a "$work/openblas.txt"
  if [ -n "$ms" ] && [ "$ms" -lt "$best_ms" ]; then best=$core; best_ms=$ms; fi
done
if [ -n "$best" ] && [ "$best" != default ]; then export OPENBLAS_CORETYPE=$best; fi
echo "using OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-default}" | tee -a "$work/openblas.txt"

if [ "$phase" = bench ]; then
  timeout 150 stdbuf -oL fluxion bench attention --contexts 4096,16384,65536,131072 --threads 1 \
    --repeats 10 --policy full,exact_topk,quest,lfps,lfps_paper,fluxion,fixed_32_0.05 \
    --budget 0.02,0.05 --json "$work/attention-xeon.json" > "$work/attention-xeon.txt" 2>&1
  tail -40 "$work/attention-xeon.txt"
fi

run_unit() {
  local ctx=$1 task=$2 seed=$3 name="$work/$1-$2-$3"
  fluxion eval tasks --model models/fluxion-tiny-retrieval --tasks "$task" --contexts "$ctx" \
    --samples 1 --seed "$seed" --threads 1 --budget 0.02,0.05 \
    --policy full,exact_topk,quest,lfps,lfps_paper,fluxion,fluxion_rules,fixed_32_0.02,fixed_32_0.05 \
    --json "$name.json.part" > "$name.txt" 2>&1 && mv "$name.json.part" "$name.json"
}
export -f run_unit
export work
left=$(( seconds - ($(date +%s) - start) - 20 ))
echo "eval for ${left}s"
timeout "$left" xargs -a "$units" -P "$(nproc)" -L 1 bash -c 'run_unit "$@"' _
echo "units done: $(ls "$work"/*.json 2>/dev/null | wc -l) of $(wc -l < "$units")"
tar -czf "$out/session6-$(basename "$units" .txt).tar.gz" -C "$work" .
