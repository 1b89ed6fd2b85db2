#!/usr/bin/env bash
# Session 13, device call 6 (issue 15): the per-layer CRC and page bounds folded into each piece
# as its pages complete (call 5 found them bunched after the forward): the GPU prefill's device
# test, then TTFT layer-wise at 8K / 32K / 128K over TCP.
source "$(dirname "$0")/prologue.sh"
timeout 240 "$bin/prefill_device_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure' | head -20 | tee "$out/tests.log"
{
  timeout 300 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 8192,32768,130048 --send layerwise --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/prefill-8b-tcp-digest.json"
  echo "rc $?"
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/bench.log"
tar -C "$out" -cJf /tmp/session13-call6.tar.xz . && rm -rf "$out"/* && mv /tmp/session13-call6.tar.xz "$out/"
