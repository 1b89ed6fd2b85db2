#!/usr/bin/env bash
# Session 9 device call (issue 14, the HBM-resident step within 10% of torch): the fused / graphed /
# tuned dense half. Device tests first (fused vs plain ops, graphed vs eager step bit for bit, the
# tuned GEMMs vs the default with their choices printed, the device span list, the HBM step vs
# host attention), then the dense half alone (fused, and replayed as one graph), then the
# hbm-full column of `bench decode` and torch's anchor in the same call. Build and bundle here:
#   cmake --build build --target fluxion model_cuda_test kernels_cuda_test cuda_resident_window_test
#   ../shared/device/bundle.sh .device build/fluxion build/model/model_cuda_test \
#       build/kernels/cuda/kernels_cuda_test build/decode/cuda_resident_window_test
#   tar -cJf .device.tar.xz .device
# then run with carry [".device.tar.xz"] (anchor: ../shared/bench/anchor_hbm_decode.py copied into
# the carried tree as anchor_hbm_decode.py, or ANCHOR=path).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX
{
  echo "== model_cuda_test"
  "$bin/model_cuda_test" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected|worst"
  echo "== kernels_cuda_test (dense, GEMM, spans)"
  "$bin/kernels_cuda_test" --gtest_filter='Gemm*:PageSpans*:CudaOps*:DecodeOps*' 2>&1 \
    | grep -E "^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected|gemm choice"
  echo "== cuda_resident_window_test"
  "$bin/cuda_resident_window_test" 2>&1 | grep -E "^\[ +(FAILED|PASSED) |^\[==========\]|Failure"
} 2>&1 | tee "$out/tests.log"
timeout 240 "$bin/fluxion" bench gpu --batch 1,4,16 --contexts 32768 --read-fraction 0.05 \
  --page-tokens 16 --paged-kernels v4s2 --repeats 10 --json "$out/gpu.json" 2>&1 \
  | tee "$out/gpu.log" | grep -A8 "dense step"
timeout 400 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 32768,131072 --batch 1,4,16 --policy full --steps 8 --cpu-threads 16 \
  --json "$out/hbm.json" 2>&1 | tee "$out/hbm.log" | grep -E "hbm-full|skipped"
anchor=${ANCHOR:-anchor_hbm_decode.py}
[[ -f $anchor ]] && timeout 300 python3 "$anchor" --points 1x32768,4x32768,16x32768,1x131072,4x131072 \
  --json "$out/anchor.json" 2>&1 | tee "$out/anchor.log"
ls -la "$out"
