#!/usr/bin/env bash
# Session 14, device call 2 (issue 15): the page records computed on the GPU beside their pages
# (kernels/cuda/page_meta_encode.h): the prefill kernels' and the GPU prefill's device tests
# (records byte-equal to the host encoder's), then TTFT layer-wise at 8K / 32K / 128K over TCP,
# the points of session 13 call 6.
source "$(dirname "$0")/prologue.sh"
{
  timeout 120 "$bin/kernels_cuda_prefill_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED) |^\[==========\]|Failure' | tail -12
  timeout 240 "$bin/prefill_device_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure' | head -20
} 2>&1 | tee "$out/tests.log"
{
  timeout 300 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 8192,32768,130048 --send layerwise --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/prefill-8b-tcp-devmeta.json"
  echo "rc $?"
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/bench.log"
tar -C "$out" -cJf /tmp/session14-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session14-call2.tar.xz "$out/"
