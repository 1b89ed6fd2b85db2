#!/usr/bin/env bash
# One device run for the foundation (issue 2): CUDA kernel tests on the H200, the CPU kernel and
# model suites on its Xeon (AVX-512 host), and `fluxion bench model` there. Run on the GPU machine
# from the repo root after building here and bundling into .device (see ../shared/device/README.md):
#   ../shared/device/bundle.sh .device build/fluxion build/kernels/cuda/kernels_cuda_test \
#     build/kernels/cpu/kernels_cpu_test build/model/model_test build/tests/hf_reference_test
set -uo pipefail
source .device/env.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
export FLUXION_SOURCE_DIR=$PWD
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-200
  for t in kernels_cuda_test kernels_cpu_test model_test hf_reference_test; do
    echo "== $t"; "$t" --gtest_brief=1 2>&1 | tail -4
  done
} 2>&1 | tee "$out/tests.log"
fluxion bench model --preset tiny --prompt-tokens 128,1024,4096 --decode-tokens 64 \
  --threads 1,16 --repeats 3 --json "$out/model-cpu-h200host-tiny.json" 2>&1 | tee "$out/bench.log"
fluxion bench model --preset qwen2.5-0.5b --prompt-tokens 128,1024 --decode-tokens 16 \
  --threads 1,16 --repeats 2 --json "$out/model-cpu-h200host-qwen2.5-0.5b.json" 2>&1 \
  | tee -a "$out/bench.log"
