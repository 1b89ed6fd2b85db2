#!/usr/bin/env bash
# Session 22, device call A (first: the prefill's device path changed with the staging ring and is
# unverified there): every CUDA test binary (prefill_device_test pulls pages with CopyPages as the
# engine does), then session22_run3.sh's TTFT through the ring.
source "$(dirname "$0")/prologue.sh"
run_cuda_tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bash "$(dirname "$0")/session22_run3.sh"
