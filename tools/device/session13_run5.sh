#!/usr/bin/env bash
# Session 13, device call 5 (issue 15): after merging the shipped page metadata (landing reads the
# context once, on the CPU pool) and the prefill service's deferred landing: the device tests, and
# TTFT layer-wise at 8K / 32K / 128K over TCP and 32K over shared memory.
source "$(dirname "$0")/prologue.sh"
{
  timeout 120 "$bin/kernels_cuda_prefill_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED) |^\[==========\]|Failure' | head -20
  timeout 240 "$bin/prefill_device_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure|Expected|Which' | head -20
} 2>&1 | tee "$out/tests.log"
{
  timeout 300 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 8192,32768,130048 --send layerwise --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/prefill-8b-tcp-meta.json"
  echo "rc $?"
  timeout 120 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b --contexts 32768 \
    --send layerwise --ucx-tls sm,self --noucx-peer-error-handling --json "$out/prefill-8b-sm-meta.json"
  echo "rc $?"
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/bench.log"
tar -C "$out" -cJf /tmp/session13-call5.tar.xz . && rm -rf "$out"/* && mv /tmp/session13-call5.tar.xz "$out/"
