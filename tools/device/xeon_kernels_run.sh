#!/usr/bin/env bash
# One device run on the GPU host's 16-core Xeon (AVX-512-BF16/AMX): the CPU kernel and decode
# conformance suites, then the kernel, policy, top-k and model benchmarks at 1 and 16 threads.
# Build here, then:
#   ../shared/device/bundle.sh .device build/fluxion build/kernels/cpu/kernels_cpu_test \
#     build/decode/decode_test build/kernels/cuda/kernels_cuda_test
# and run `bash tools/device/xeon_kernels_run.sh` with carry [".device"].
set -uo pipefail
source .device/env.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
export FLUXION_SOURCE_DIR=$PWD
{
  lscpu | grep -E 'Model name|^CPU\(s\)' ; grep -o -w -E 'avx512f|avx512_bf16|amx_tile|avx2' /proc/cpuinfo | sort | uniq -c
  for t in kernels_cpu_test decode_test kernels_cuda_test; do
    echo "== $t"; "$t" 2>&1 | grep -E '^\[  (PASSED|FAILED|SKIPPED) |tests? from .* ran|Failure' | head -20
  done
} 2>&1 | tee "$out/conformance.log"
fluxion bench attention --contexts 4096,16384,65536,131072 --threads 1,16 --repeats 20 \
  --json "$out/attention.json" 2>&1 | tee "$out/bench.log"
fluxion bench topk --json "$out/topk.json" 2>&1 | tee -a "$out/bench.log"
fluxion bench model --preset tiny --prompt-tokens 128,1024,4096 --decode-tokens 32 \
  --threads 1,16 --repeats 2 --json "$out/model-tiny.json" 2>&1 | tee -a "$out/bench.log"
fluxion bench model --preset qwen2.5-0.5b --prompt-tokens 256 --decode-tokens 8 \
  --threads 1,16 --repeats 1 --json "$out/model-qwen.json" 2>&1 | tee -a "$out/bench.log"
