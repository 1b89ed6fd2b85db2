#!/usr/bin/env bash
# Session 23, device call 3: issue 15's batching of prompts on the GPU.
#   1. prefill_device_test (the batch tests: packed prompts equal the CPU prefill of each, a
#      prompt leaving the batch) when call 1 did not run it on this tree;
#   2. `bench prefill --batch`: Llama-3.1-8B shapes, short prompts 512 / 1K / 2K x batch 1, 4, 16,
#      layer-wise over UCX TCP on loopback: tokens/s of one forward for the batch against one
#      prompt at a time, and the batch's TTFT.
source "$(dirname "$0")/prologue.sh"
[[ -n "${SKIP_TESTS:-}" ]] || run_test 150 prefill_device_test 2>&1 | tee "$out/tests-prefill.log"
timeout 400 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
  --contexts 512,1024,2048 --batch 1,4,16 --send layerwise --repeats 3 \
  --ucx-tls tcp --ucx-net-devices lo --json "$out/s23-prefill-batch.json" 2>&1 |
  grep -v "^W2026\|^WARNING" | tee "$out/s23-prefill-batch.log"
