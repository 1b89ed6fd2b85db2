#!/usr/bin/env bash
# Session 10, device call 2 (the session's last device minutes, so in order of need):
#   1. the new GPU code's tests: the ping-pong executor vs the single pipeline on CUDA, the
#      candidate (sampling) kernel, CudaDenseOps::TopCandidates vs the CPU ops;
#   2. the 8B table at 32K, batch 4 and 8, --micro-batches 1,2: the fixed hybrids, and lfps /
#      fluxion at 0.02 after the clamp and kernel changes (compare: session 10 call 1);
#   3. fluxion local --decode-device cuda (serving with the default two micro-batches);
#   4. 4 x 128K, fixed hybrids, --micro-batches 1,2.
# Bundle: /work/shared/device/bundle.sh .device build/fluxion build/decode/cuda_resident_window_test
#   build/kernels/cuda/kernels_cuda_test build/model/model_cuda_test; tar -cf - .device |
#   xz -T2 -3 > .device.tar.xz (carry it).
source "$(dirname "$0")/prologue.sh"
summary='^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure|Expected|Which is'
{
  echo "== cuda_resident_window_test"
  timeout 60 "$bin/cuda_resident_window_test" 2>&1 | grep -E "$summary" | tail -40
  echo "== kernels_cuda_test Sampling*"
  timeout 30 "$bin/kernels_cuda_test" --gtest_filter='Sampling*' 2>&1 | grep -E "$summary" | tail -20
  echo "== model_cuda_test *TopCandidates*"
  timeout 30 "$bin/model_cuda_test" --gtest_filter='*TopCandidates*' 2>&1 | grep -E "$summary"
} 2>&1 | tee "$out/tests.log"
timeout 110 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 32768 --batch 4,8 --policy fixed_32_0.05,fixed_32_0.02,lfps,fluxion --budget 0.02 \
  --profile conservative --micro-batches 1,2 --device-read-share 0.5 --steps 3 --cpu-threads 16 \
  --json "$out/hybrid-8b-32k.json" 2>&1 | tee "$out/hybrid-8b-32k.log"
echo "== fluxion local --decode-device cuda (two micro-batches by default)" | tee "$out/local.log"
timeout 75 "$bin/fluxion" local --model models/fluxion-tiny-retrieval --decode-device cuda \
  --cpu-threads 4 --max-requests 24 --out-dir "$out/local-cuda" --json "$out/local-cuda.json" \
  2>&1 | tail -20 | tee -a "$out/local.log"
rm -rf "$out/local-cuda"
timeout 90 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 131072 --batch 4 --policy fixed_32_0.05,fixed_32_0.02 --micro-batches 1,2 \
  --device-read-share 0.5 --steps 3 --cpu-threads 16 \
  --json "$out/hybrid-8b-128k.json" 2>&1 | tee "$out/hybrid-8b-128k.log"
