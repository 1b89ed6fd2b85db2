#!/usr/bin/env bash
# Session 14, device call 1: the tensor-core paged decode kernel (PagedKernel::kV5,
# kernels/cuda/paged_decode_mma.cu) against v4 / v4s2:
#   1. kernels_cuda_test (paged decode: every kernel against the reference, device and pinned
#      host memory), kernels_cuda_attention_test (the backend's conformance grid, v5 included);
#   2. `fluxion bench gpu`: one layer's attention over HBM pages and zero-copy, every kernel;
#   3. the HBM-resident whole step (`bench decode --hbm-kernels v4s2,v5,v5s2`) at the points of
#      issue 14's HBM target (16 x 32K, 4 x 128K, 1 x 128K), and torch's in the same call.
source "$(dirname "$0")/prologue.sh"
{
  timeout 120 "$bin/kernels_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected|Which is|error' | tail -40
  timeout 180 "$bin/kernels_cuda_attention_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -20
} 2>&1 | tee "$out/tests.log"
timeout 120 "$bin/fluxion" bench gpu --dense-step=false --paged-kernels v4,v4s2,v5,v5s2 \
  --batch 1,4,16 --contexts 32768,131072 --read-fraction 0.05 --json "$out/gpu-kernels.json" \
  2>&1 | tee "$out/gpu-kernels.log"
common=(--device cuda --preset llama3.1-8b --budget 0.02 --steps 5 --cpu-threads 16
        --device-read-share 0.5 --policy fixed_32_0.02 --hbm-kernels v4s2,v5,v5s2)
timeout 150 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 1,4 \
  --host-memory-gib 80 --json "$out/hbm-128k.json" 2>&1 | tee "$out/hbm-128k.log"
timeout 110 "$bin/fluxion" bench decode "${common[@]}" --contexts 32768 --batch 16 \
  --host-memory-gib 80 --json "$out/hbm-32k.json" 2>&1 | tee "$out/hbm-32k.log"
timeout 150 python3 bench/anchor_hbm_decode.py --points 16x32768,4x131072,1x131072 \
  --json "$out/torch-hbm.json" 2>&1 | tail -8 | tee "$out/torch-hbm.log"
tar -C "$out" -cJf /tmp/session14-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session14-call1.tar.xz "$out/"
