#!/usr/bin/env bash
# Session 9, device call 3: after merging the fused/graphed dense half, decision profiles and the
# eval through the hybrid path. CUDA tests first, serving with the hybrid step (the arena pinned,
# the scheduler within the window's slots), then our HBM-resident step against torch's in the
# same call, then the 8B table at 32K and 64K (every policy; lfps and fluxion under the
# conservative and the measured 16K profile; device block scores, zero-copy share 0.5).
# Bundle: /work/shared/device/bundle.sh .device build/fluxion build/decode/cuda_resident_window_test
#   build/model/model_cuda_test build/kernels/cuda/kernels_cuda_test build/tests/eval_cuda_test;
#   tar -cf - .device | xz -T2 -3 > .device.tar.xz (carry it).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX FLUXION_SOURCE_DIR=$PWD
for t in kernels_cuda_test model_cuda_test cuda_resident_window_test eval_cuda_test; do
  echo "== $t"
  timeout 120 "$bin/$t" 2>&1 | grep -E "^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected|Which is|gemm choice|identical" | tail -60
done 2>&1 | tee "$out/tests.log"
echo "== fluxion local --decode-device cuda" | tee "$out/local.log"
timeout 120 "$bin/fluxion" local --model models/fluxion-tiny-retrieval --decode-device cuda \
  --cpu-threads 4 --max-requests 24 --out-dir "$out/local-cuda" --json "$out/local-cuda.json" \
  2>&1 | tail -25 | tee -a "$out/local.log"
for f in "$out/local-cuda"/logs/decode-*.log; do [[ -f $f ]] && { echo "== $f"; tail -5 "$f"; }; done \
  2>&1 | tee -a "$out/local.log"
rm -rf "$out/local-cuda"
timeout 120 python3 bench/anchor_hbm_decode.py --points 1x32768,4x32768,16x32768,1x131072,4x131072 \
  --json "$out/anchor.json" 2>&1 | grep -v Warning | grep -v "scaled_dot_product" | tee "$out/anchor.log"
timeout 420 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 32768,65536 --batch 1,4,8,16 \
  --policy full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05,lfps,fluxion --budget 0.05 \
  --profile conservative,bench/profiles/tiny-retrieval-16k.json --device-read-share 0.5 \
  --steps 3 --cpu-threads 16 --json "$out/hybrid-8b.json" 2>&1 | tee "$out/hybrid-8b.log"
ls -la "$out"
