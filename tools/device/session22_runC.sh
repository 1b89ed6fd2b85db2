#!/usr/bin/env bash
# Session 22, device call C (the last few device minutes after eight failed starts): the prefill's
# device test (the staging ring's path on the GPU), then TTFT through the ring at 8K and 32K.
source "$(dirname "$0")/prologue.sh"
run_test 120 prefill_device_test 2>&1 | tee "$out/tests.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b --contexts 8192,32768 \
  --send layerwise,after --ucx-tls tcp --ucx-net-devices lo --json "$out/s22-prefill-8b-ring512.json" 2>&1 |
  grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/s22-prefill.log"
