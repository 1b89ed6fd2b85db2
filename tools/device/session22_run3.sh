#!/usr/bin/env bash
# Session 22, device call 3: issue 15's TTFT after the bounded staging ring (prefill/staging_ring.h).
#   1. `bench prefill` at Llama-3.1-8B shapes, 8K / 32K / 128K, layer-wise through the default
#      512 MiB ring and after the last layer (whole-prompt staging, the baseline), UCX over TCP on
#      loopback as in session 13's table;
#   2. the same, layer-wise only, through a 64 MiB ring at 32K and 128K: does a small ring make
#      the compute wait?
source "$(dirname "$0")/prologue.sh"
{
  timeout 300 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 8192,32768,131072 --send layerwise,after --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/s22-prefill-8b-ring512.json"
  echo "rc $?"
  timeout 200 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 32768,131072 --send layerwise --staging-ring-mib 64 --ucx-tls tcp \
    --ucx-net-devices lo --json "$out/s22-prefill-8b-ring64.json"
  echo "rc $?"
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/s22-prefill.log"
