#!/usr/bin/env bash
# Session 7, device call 3: CUDA kernel tests and `fluxion bench gpu` with the v3 paged kernel,
# then issue 13's batched decode step on the host Xeon (16 cores): `fluxion bench decode` with the
# trained model, batched CPU executor vs the per-request loop in the same run. Bundle as in
# session7_gpu_run.sh (carry .device.tar.xz). PART=gpu|xeon-tiny|xeon-qwen selects a part.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX  # docs/DEPENDENCIES.md: OpenBLAS's own pick is 3x slower here
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)" > "$out/cpu.txt"
case "${PART:-gpu}" in
  gpu)
    { echo "== kernels_cuda_test"; "$bin/kernels_cuda_test" 2>&1 | grep -E "OK|FAILED|PASSED"
      echo "== fluxion bench gpu"
      "$bin/fluxion" bench gpu --batch 1,4,16 --contexts 32768,65536,131072 \
        --read-fraction 0.05,0.02 --repeats 20 --json "$out/gpu-bench.json"; } 2>&1 | tee "$out/gpu.log"
    ;;
  xeon-tiny)
    "$bin/fluxion" bench decode --model models/fluxion-tiny-retrieval --contexts 1024,4096,16384 \
      --batch 1,4,8,16 --policy full,fluxion --budget 0.05 --threads 1,16 --steps 3 \
      --json "$out/decode-tiny.json" 2>&1 | tee "$out/decode-tiny.log"
    ;;
  xeon-qwen)
    "$bin/fluxion" bench decode --preset qwen2.5-0.5b --kv random --contexts 1024,4096 \
      --batch 1,4,8,16 --policy full,fluxion --budget 0.05 --threads 1,16 --steps 2 \
      --json "$out/decode-qwen.json" 2>&1 | tee "$out/decode-qwen.log"
    ;;
esac
