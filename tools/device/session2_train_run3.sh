#!/usr/bin/env bash
# Device call 1 of session 2: the Xeon conformance suites of the CPU kernels (AVX-512 included) in
# the background, and training run 3 of fluxion-tiny-retrieval in the foreground (phase F: the hard
# tasks twice per sequence, answer-loss weights vt=3 aggregate=2 passage=1.5, no weight decay on the
# tied embeddings and norm gains), initialised from the committed run-2 export.
# Carry [".device"] (bundle of build/fluxion, kernels_cpu_test, decode_test).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
(
  source .device/env.sh
  export FLUXION_SOURCE_DIR=$PWD OMP_NUM_THREADS=4
  {
    lscpu | grep -E 'Model name|^CPU\(s\)'
    grep -o -w -E 'avx512f|avx512_bf16|amx_tile|avx2' /proc/cpuinfo | sort | uniq -c
    for t in kernels_cpu_test decode_test; do
      echo "== $t"
      "$t" 2>&1 | grep -E '^\[  (PASSED|FAILED|SKIPPED) |tests? from .* ran|Failure|isa|ISA' | head -40
    done
  } > "$out/conformance-xeon.log" 2>&1
) &
PYTHONUNBUFFERED=1 python3 tools/train/train.py --out "$out/r3" --init-from models/fluxion-tiny-retrieval \
  --start-step 8249 --lr 6e-4 --warmup 100 --time-budget-s 430 --deadline-s 560 --workers 8 \
  --label-weights vt=3,aggregate=2,passage=1.5 --no-decay-embed-norm \
  --quick-eval 30 --quick-lengths 1024,4096 --export /tmp/export 2>&1 | grep -v Warning | tail -60
wait
