#!/usr/bin/env bash
# Session 12, device call 1:
#   1. kernels_cuda_ring_test (TopBlocks against the CPU selection on adversarial scores),
#      cuda_resident_window_test (the window's ranking against TopKIndices on its own scores),
#      eval_cuda_test (the whole hybrid path: quest / fixed_32 now take the device's picks);
#   2. the fixed hybrids at 8B shapes, this tree (device-ranked blocks, the adaptive CPU radix
#      select, host_s split into prep / kernel) against `fluxion-base` (85e43cf, session 11's
#      main), same call: 1 x 128K and 4 x 128K, then 32K at batch 1, 4, 16;
#   3. the zero-copy share at 1 x 128K, 0.02: 0.5 / 0.65 / 0.8;
#   4. --degrade-on-stall at 4 x 32K.
# Everything comes back in one archive.
source "$(dirname "$0")/prologue.sh"
{
  timeout 60 "$bin/kernels_cuda_ring_test" 2>&1 | tail -5
  timeout 120 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 150 "$bin/eval_cuda_test" 2>&1 | tail -12
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --steps 5 --cpu-threads 16)
# --join (this tree only): after each point one more request is admitted off the step while the
# batch steps on (the spare request exists below the largest batch).
for b in fluxion fluxion-base; do
  extra=(); [[ $b == fluxion ]] && extra=(--join)
  timeout 170 "$bin/$b" bench decode "${common[@]}" "${extra[@]}" --device-read-share 0.5 \
    --contexts 131072 --batch 1,4 --host-memory-gib 80 --policy fixed_32_0.05,fixed_32_0.02 \
    --json "$out/fixed-128k-$b.json" 2>&1 | tee "$out/fixed-128k-$b.log"
done
for b in fluxion fluxion-base; do
  extra=(); [[ $b == fluxion ]] && extra=(--join)
  timeout 120 "$bin/$b" bench decode "${common[@]}" "${extra[@]}" --device-read-share 0.5 \
    --contexts 32768 --batch 1,4,16 --host-memory-gib 80 --policy fixed_32_0.05,fixed_32_0.02 \
    --json "$out/fixed-32k-$b.json" 2>&1 | tee "$out/fixed-32k-$b.log"
done
timeout 100 "$bin/fluxion" bench decode "${common[@]}" --device-read-share 0.5,0.65,0.8 \
  --contexts 131072 --batch 1 --host-memory-gib 24 --policy fixed_32_0.02,fixed_32_0.05 \
  --json "$out/share-128k.json" 2>&1 | tee "$out/share-128k.log"
# Dynamic degradation (the stall guard) at 4 x 32K, this tree: the degraded step's picks now come
# from the device at the degraded scale; plan_ms split into scores_wait / select shows where a
# degraded step's plan time goes (session 11: 7.2 ms against 2.5-3.3 undegraded, unexplained).
timeout 90 "$bin/fluxion" bench decode "${common[@]}" --device-read-share 0.5 --degrade-on-stall \
  --contexts 32768 --batch 4 --host-memory-gib 24 --policy fixed_32_0.05,fixed_32_0.02 \
  --json "$out/degrade-32k.json" 2>&1 | tee "$out/degrade-32k.log"
tar -C "$out" -cJf /tmp/session12-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session12-call1.tar.xz "$out/"
