#!/usr/bin/env bash
# Session 11, device call 3:
#   1. cuda_resident_window_test (the chunked pinned upload of page bounds at admission, on a
#      pool, against the host window's scores) and eval_cuda_test (the whole hybrid path);
#   2. admission time, this tree (5f8f8cc) against `fluxion-base`: session 10's window code with
#      only the admission counter and bench columns added (tools: a cherry-pick of 5f8f8cc with
#      decode/cuda_resident_window.* of ea2aaca), same call, 32K and 128K;
#   3. the 4 x 128K points call 2 skipped (host limit), this tree.
# Everything comes back in one archive.
source "$(dirname "$0")/prologue.sh"
{
  timeout 100 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 100 "$bin/eval_cuda_test" 2>&1 | tail -12
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --device-read-share 0.5 --steps 3
        --cpu-threads 16)
for b in fluxion fluxion-base; do
  timeout 90 "$bin/$b" bench decode "${common[@]}" --contexts 32768 --batch 1,4 \
    --host-memory-gib 24 --policy fixed_32_0.05 \
    --json "$out/admit-32k-$b.json" 2>&1 | tee "$out/admit-32k-$b.log"
done
timeout 120 "$bin/fluxion-base" bench decode "${common[@]}" --contexts 131072 --batch 1 \
  --host-memory-gib 24 --policy fixed_32_0.05 \
  --json "$out/admit-128k-fluxion-base.json" 2>&1 | tee "$out/admit-128k-fluxion-base.log"
timeout 300 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 1,4 \
  --host-memory-gib 80 --policy fixed_32_0.05,fixed_32_0.02,lfps,fluxion --profile conservative \
  --json "$out/hybrid-8b-128k.json" 2>&1 | tee "$out/hybrid-8b-128k.log"
tar -C "$out" -cJf /tmp/session11-call3.tar.xz . && rm -rf "$out"/* && mv /tmp/session11-call3.tar.xz "$out/"
