#!/usr/bin/env bash
# Session 8, device calls 2 and 3 (issue 14 and 13), back to back while the machine is warm.
#   PART=a: every CUDA test binary (correctness first), `fluxion bench gpu` with the paged kernels
#           v3/v4/v4s2/v4t and the dense step, torch's HBM-resident whole step (the anchor), and
#           issue 13's batched CPU executor on the host Xeon at qwen2.5-0.5b shapes.
#   PART=b: the hybrid step table at Llama-3.1-8B shapes with the HBM-resident reference rows.
# Build and bundle here:
#   ninja -C build fluxion kernels_cuda_test kernels_cuda_attention_test model_cuda_test \
#       cuda_resident_window_test
#   /work/shared/device/bundle.sh .device build/fluxion build/kernels/cuda/kernels_cuda_test \
#       build/kernels/cuda/kernels_cuda_attention_test build/model/model_cuda_test \
#       build/decode/cuda_resident_window_test
#   tar -cf - .device | xz -T2 -3 > .device.tar.xz
# then run with carry [".device.tar.xz"].
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX  # docs/DEPENDENCIES.md: OpenBLAS's own pick is 3x slower here
case "${PART:-a}" in
  a)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.txt"
    {
      for t in kernels_cuda_test kernels_cuda_attention_test model_cuda_test \
               cuda_resident_window_test; do
        echo "== $t"
        "$bin/$t" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected|Which is|error" | tail -40
      done
    } 2>&1 | tee "$out/tests.log"
    timeout 170 "$bin/fluxion" bench gpu --batch 1,16 --contexts 32768,131072 --read-fraction 0.05 \
      --page-tokens 16 --paged-kernels v3,v4,v4s2,v4t --repeats 10 --dense-step \
      --json "$out/gpu-bench.json" 2>&1 | tee "$out/gpu-bench.log"
    timeout 150 python3 bench/anchor_hbm_decode.py \
      --points 1x32768,4x32768,16x32768,1x65536,4x65536,1x131072,4x131072 \
      --json "$out/anchor.json" 2>&1 | tee "$out/anchor.log"
    timeout 120 "$bin/fluxion" bench decode --preset qwen2.5-0.5b --kv random --contexts 16384 \
      --batch 1,4,16 --policy full,quest --budget 0.05 --cpu-threads 16 --steps 2 \
      --json "$out/decode-qwen-16k.json" 2>&1 | tee "$out/decode-qwen-16k.log"
    ;;
  b)
    timeout 560 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
      --contexts 32768,65536,131072 --batch 1,4,8,16 \
      --policy full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05 --steps 3 --cpu-threads 16 \
      --json "$out/hybrid-8b.json" 2>&1 | tee "$out/hybrid-8b.log"
    ;;
esac
ls -la "$out"
