#!/usr/bin/env bash
# Session 22, device call A (first: the prefill's device path changed with the staging ring and is
# unverified there): every CUDA test binary (prefill_device_test pulls pages with CopyPages as the
# engine does), then session22_run3.sh's TTFT through the ring.
source "$(dirname "$0")/prologue.sh"
{
  run_test 120 prefill_device_test
  run_test 120 kernels_cuda_prefill_test
  run_test 120 kernels_cuda_test
  run_test 60 kernels_cuda_ring_test
  run_test 180 kernels_cuda_attention_test
  run_test 120 model_cuda_test
  run_test 90 cuda_resident_window_test
  run_test 150 eval_cuda_test
} 2>&1 | tee "$out/tests.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bash "$(dirname "$0")/session22_run3.sh"
