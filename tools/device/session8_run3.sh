#!/usr/bin/env bash
# Session 8, device call 4: after removing the per-layer stream wait from the decode step and
# switching the HBM attention to the v4 two-stage kernel: the CUDA step tests, then our
# HBM-resident whole step and torch's (anchor) in the same call, with the hybrid step beside them.
# Bundle as in session8_run2.sh (carry .device.tar.xz).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX
for t in cuda_resident_window_test model_cuda_test; do
  echo "== $t"
  "$bin/$t" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected|Which is" | tail -30
done 2>&1 | tee "$out/tests.log"
timeout 300 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 32768,131072 --batch 1,4,16 --policy fixed_32_0.05 --steps 5 --cpu-threads 16 \
  --json "$out/hybrid-8b.json" 2>&1 | tee "$out/hybrid-8b.log"
timeout 150 python3 bench/anchor_hbm_decode.py --points 1x32768,4x32768,16x32768,1x131072,4x131072 \
  --json "$out/anchor.json" 2>&1 | grep -v Warning | grep -v "scaled_dot_product" | tee "$out/anchor.log"
ls -la "$out"
