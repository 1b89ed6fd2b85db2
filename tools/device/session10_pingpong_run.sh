#!/usr/bin/env bash
# Session 10 (issue 14, ping-pong micro-batches): the CUDA tests (the ping-pong executor against
# the single pipeline: HybridOnCudaTest.PingPongMatchesTheSinglePipeline), serving with the
# default two micro-batches, then the 8B table with --micro-batches 1,2 in the same run (the
# strongest fixed hybrid and full at 32K and 128K, batch 1-16, zero-copy share 0.5).
# Bundle: /work/shared/device/bundle.sh .device build/fluxion build/decode/cuda_resident_window_test
#   build/model/model_cuda_test; tar -cf - .device | xz -T2 -3 > .device.tar.xz (carry it).
source "$(dirname "$0")/prologue.sh"
for t in model_cuda_test cuda_resident_window_test; do
  echo "== $t"
  timeout 150 "$bin/$t" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure|Expected|Which is" | tail -60
done 2>&1 | tee "$out/tests.log"
echo "== fluxion local --decode-device cuda (micro-batches 2 by default)" | tee "$out/local.log"
timeout 120 "$bin/fluxion" local --model models/fluxion-tiny-retrieval --decode-device cuda \
  --cpu-threads 4 --max-requests 24 --out-dir "$out/local-cuda" --json "$out/local-cuda.json" \
  2>&1 | tail -25 | tee -a "$out/local.log"
for f in "$out/local-cuda"/logs/decode-*.log; do [[ -f $f ]] && { echo "== $f"; tail -5 "$f"; }; done \
  2>&1 | tee -a "$out/local.log"
rm -rf "$out/local-cuda"
timeout 480 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 32768,131072 --batch 1,4,8,16 --policy full,fixed_32_0.05 --budget 0.05 \
  --micro-batches 1,2 --device-read-share 0.5 --steps 3 --cpu-threads 16 \
  --json "$out/hybrid-8b-pingpong.json" 2>&1 | tee "$out/hybrid-8b-pingpong.log"
ls -la "$out"
