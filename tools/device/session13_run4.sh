#!/usr/bin/env bash
# Session 13, device call 4 (issue 15): K's B fragments through ldmatrix.x4 (one instruction for
# eight 32-bit loads) in the prefill attention: the device tests again, then 32K and 64K layer-wise
# against call 2's compute (3,009 and 10,389 ms).
source "$(dirname "$0")/prologue.sh"
{
  timeout 120 "$bin/kernels_cuda_prefill_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure|Expected|Which|worst|actual' | head -40
  timeout 240 "$bin/prefill_device_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure|Expected|Which|worst|actual|error' | head -40
} 2>&1 | tee "$out/tests.log"
{
  timeout 300 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 8192,32768,65536 --send layerwise --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/prefill-8b-tcp-ldmatrix.json"
  echo "rc $?"
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/bench.log"
tar -C "$out" -cJf /tmp/session13-call4.tar.xz . && rm -rf "$out"/* && mv /tmp/session13-call4.tar.xz "$out/"
