#!/usr/bin/env bash
# Session 22, device call B (call A trimmed to what little device time was left after the machine
# failed to start seven times): the prefill's device tests (the staging ring's path), then TTFT
# through the 512 MiB ring at 8K / 32K / 128K, layer-wise, and at 32K after the last layer.
source "$(dirname "$0")/prologue.sh"
{
  run_test 120 prefill_device_test
  run_test 120 kernels_cuda_prefill_test
} 2>&1 | tee "$out/tests.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
{
  timeout 200 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 8192,32768,131072 --send layerwise --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/s22-prefill-8b-ring512.json"
  echo "rc $?"
  timeout 60 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 32768 --send after --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/s22-prefill-8b-after.json"
  echo "rc $?"
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/s22-prefill.log"
