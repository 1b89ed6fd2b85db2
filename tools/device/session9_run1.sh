#!/usr/bin/env bash
# Session 9, device call 1: block scores on the device and zero-copy reads of part of the host
# rows. Correctness first (the CUDA window's scores against the host window's, the hybrid step on
# CUDA with device scores and zero-copy shares against host attention), then the 8B hybrid table
# with both sources of block scores and three device read shares in one run.
# Bundle: /work/shared/device/bundle.sh .device build/fluxion build/decode/cuda_resident_window_test
#   build/model/model_cuda_test; tar -cf - .device | xz -T2 -3 > .device.tar.xz (carry it).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
ulimit -l | tee -a "$out/gpu.txt"
for t in cuda_resident_window_test model_cuda_test; do
  echo "== $t"
  "$bin/$t" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure|Expected|Which is" | tail -60
done 2>&1 | tee "$out/tests.log"
timeout 420 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 32768,131072 --batch 1,4 --policy fixed_32_0.05,fixed_16_0.05 \
  --block-scores device,cpu --device-read-share 0,0.3,0.5 --steps 4 --cpu-threads 16 \
  --json "$out/hybrid-8b.json" 2>&1 | tee "$out/hybrid-8b.log"
ls -la "$out"
