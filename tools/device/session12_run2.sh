#!/usr/bin/env bash
# Session 12, device call 2 (after call 1 showed an off-step admission on the step's OpenMP pool
# slowing every later step: a second OpenMP team makes libgomp throttle its spinning):
#   1. kernels_cuda_ring_test, cuda_resident_window_test (ranked rows whose scores stay on the
#      device), eval_cuda_test;
#   2. the fixed hybrids, this tree (device-ranked blocks; per-pair span planning on the pool;
#      only the picks cross) against `fluxion-base` (85e43cf), same call, no --join: 1 x 128K and
#      4 x 128K, then 32K at batch 1, 4, 16;
#   3. --join (this tree): one more request admitted off the step on plain threads while the
#      batch steps on: 128K at batch 1, 32K at batch 4;
#   4. torch's HBM-resident whole step (bench/anchor_hbm_decode.py) at the points of the HBM
#      target: 16 x 32K, 4 x 128K, 1 x 128K.
# Everything comes back in one archive.
source "$(dirname "$0")/prologue.sh"
{
  timeout 60 "$bin/kernels_cuda_ring_test" 2>&1 | tail -3
  timeout 120 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 150 "$bin/eval_cuda_test" 2>&1 | tail -10
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --steps 5 --cpu-threads 16
        --device-read-share 0.5 --policy fixed_32_0.05,fixed_32_0.02)
for b in fluxion fluxion-base; do
  timeout 150 "$bin/$b" bench decode "${common[@]}" --contexts 131072 --batch 1,4 \
    --host-memory-gib 80 --json "$out/fixed-128k-$b.json" 2>&1 | tee "$out/fixed-128k-$b.log"
done
for b in fluxion fluxion-base; do
  timeout 110 "$bin/$b" bench decode "${common[@]}" --contexts 32768 --batch 1,4,16 \
    --host-memory-gib 80 --json "$out/fixed-32k-$b.json" 2>&1 | tee "$out/fixed-32k-$b.log"
done
timeout 90 "$bin/fluxion" bench decode "${common[@]}" --join --contexts 131072 --batch 1 \
  --host-memory-gib 40 --json "$out/join-128k.json" 2>&1 | tee "$out/join-128k.log"
timeout 70 "$bin/fluxion" bench decode "${common[@]}" --join --contexts 32768 --batch 4,8 \
  --host-memory-gib 40 --json "$out/join-32k.json" 2>&1 | tee "$out/join-32k.log"
timeout 150 python3 bench/anchor_hbm_decode.py --points 16x32768,4x131072,1x131072 \
  --json "$out/torch-hbm.json" 2>&1 | tail -8 | tee "$out/torch-hbm.log"
tar -C "$out" -cJf /tmp/session12-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session12-call2.tar.xz "$out/"
