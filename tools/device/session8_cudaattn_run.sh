#!/usr/bin/env bash
# Session 8 device call (issue 14, CUDA attention): the CUDA kernel tests and the device
# conformance suite of the attention backend first, then `fluxion bench gpu` with the old (v3) and
# new (v4) paged kernels side by side against the copy probes. Build and bundle here first:
#   cmake --build build --target fluxion kernels_cuda_test kernels_cuda_attention_test
#   ../shared/device/bundle.sh .device build/fluxion build/kernels/cuda/kernels_cuda_test \
#       build/kernels/cuda/kernels_cuda_attention_test
#   tar -cJf .device.tar.xz .device
# then run with carry [".device.tar.xz"]. BENCH_ARGS overrides the bench's point list.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
args=${BENCH_ARGS:---batch 1,4,16 --contexts 32768,65536,131072 --read-fraction 0.05,0.02 --page-tokens 16,32,64 --paged-kernels v3,v4,v4s2,v4t --repeats 20}
{
  echo "== kernels_cuda_test"; "$bin/kernels_cuda_test" 2>&1 | grep -v '^\[ *\(RUN\|OK\) ' | tail -60
  echo "== kernels_cuda_attention_test"
  "$bin/kernels_cuda_attention_test" 2>&1 | grep -v '^\[ *\(RUN\|OK\) ' | tail -60
  echo "== fluxion bench gpu $args"
  # shellcheck disable=SC2086
  "$bin/fluxion" bench gpu $args --json "$out/gpu-bench.json"
} 2>&1 | tee "$out/log.txt"
ls -la "$out"
