#!/usr/bin/env bash
# Session 8, device call 6: the final check of the committed code after the window's slot
# bookkeeping was shared (WindowSlots): the CUDA step tests, serving with --decode-device cuda, and
# one hybrid point at 8B shapes. Bundle: fluxion, cuda_resident_window_test, model_cuda_test.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX
for t in cuda_resident_window_test model_cuda_test; do
  echo "== $t"
  "$bin/$t" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected" | tail -20
done 2>&1 | tee "$out/tests.log"
timeout 120 "$bin/fluxion" local --model models/fluxion-tiny-retrieval --decode-device cuda \
  --cpu-threads 4 --max-requests 24 --out-dir "$out/local-cuda" 2>&1 | tail -16 | tee "$out/local.log"
timeout 150 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b --contexts 32768 \
  --batch 1,4 --policy fixed_32_0.05 --steps 3 --cpu-threads 16 --json "$out/hybrid.json" \
  2>&1 | tee "$out/hybrid.log"
