#!/usr/bin/env bash
# Session 9, device call 2: CUDA tests, one hybrid series with the plan phase split (append /
# waiting for block scores / selection), then the task eval through the CUDA hybrid executor
# against the CPU path on the same seeds (tools/device/eval_device_compare.sh).
# Bundle: /work/shared/device/bundle.sh .device build/fluxion build/decode/cuda_resident_window_test
#   build/model/model_cuda_test build/tests/eval_cuda_test; tar -cf - .device | xz -T2 -3 >
#   .device.tar.xz (carry it).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX
for t in cuda_resident_window_test model_cuda_test; do
  echo "== $t"
  "$bin/$t" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure|Expected|Which is" | tail -60
done 2>&1 | tee "$out/tests.log"
timeout 150 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 131072 --batch 1,4 --policy fixed_32_0.05 --device-read-share 0,0.5 --steps 4 \
  --cpu-threads 16 --json "$out/hybrid-8b.json" 2>&1 | tee "$out/hybrid-8b.log"
OUT=$out bash tools/device/eval_device_compare.sh 8 1024,4096 8
ls -la "$out"
