#!/usr/bin/env bash
# Session 8, device call 5: `fluxion decode --device cuda` in the serving loop. The CUDA step
# tests (the resident window now at head_dim 32 too), then `fluxion local` (router, prefill and
# decode processes, real gRPC and UCX) serving the bundled trace with the trained model, decode
# nodes on the CPU and then on the GPU (the hybrid step), same trace. Bundle as in
# session8_run2.sh (fluxion + cuda_resident_window_test; carry .device.tar.xz).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX
"$bin/cuda_resident_window_test" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected" \
  | tee "$out/tests.log"
for dev in cpu cuda; do
  echo "== fluxion local --decode-device $dev"
  timeout 150 "$bin/fluxion" local --model models/fluxion-tiny-retrieval --decode-device "$dev" \
    --cpu-threads 4 --max-requests 24 --out-dir "$out/local-$dev" --json "$out/local-$dev.json" \
    2>&1 | tail -40
done 2>&1 | tee "$out/local.log"
for dev in cpu cuda; do
  for f in "$out/local-$dev"/logs/decode-*.log; do
    [[ -f $f ]] && { echo "== $f"; tail -5 "$f"; }
  done
done 2>&1 | tee -a "$out/local.log"
ls -la "$out"
