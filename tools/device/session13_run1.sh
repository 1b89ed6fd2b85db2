#!/usr/bin/env bash
# Session 13, device call 1 (issue 15): the GPU prefill's device tests, then first timings:
# `fluxion bench prefill` at Llama-3.1-8B shapes (random weights on the GPU, UCX over TCP on
# loopback, a forked decode side landing with the decode node's code) at 8K and 32K, and torch's
# prefill of the same shapes.
source "$(dirname "$0")/prologue.sh"
{
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  timeout 120 "$bin/kernels_cuda_prefill_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure|Expected|Which|worst|actual' | head -60
  timeout 240 "$bin/prefill_device_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure|Expected|Which|worst|actual|error' | head -60
} 2>&1 | tee "$out/tests.log"
{
  timeout 300 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b --contexts 8192,32768 \
    --send layerwise,after --ucx-tls tcp --ucx-net-devices lo --json "$out/prefill-8b-tcp.json"
  echo "rc $?"
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/bench.log"
timeout 200 python3 bench/anchor_prefill.py --contexts 8192,32768 --chunk 2048 \
  --json "$out/anchor-prefill.json" 2>&1 | tail -8 | tee "$out/anchor.log"
tar -C "$out" -cJf /tmp/session13-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session13-call1.tar.xz "$out/"
