#!/usr/bin/env bash
# Session 17, device call 3: LFPS / Fluxion at Llama-3.1-8B shapes after this session's
# head-step work (table clamps over a floor, the dense table pass in chunks, picks marked into a
# bitmap, no allocation per head-step; commits fbc6bfe..c93cd9e), against the fixed hybrids,
# under the conservative and measured (tiny-retrieval-16k, with rescored_share) profiles:
#   1. eval_cuda_test (the hybrid step's outcomes equal the CPU path's), cuda_resident_window_test;
#   2. budgets 0.05 and 0.02 at 1 x 32K and 1 x 128K (8 timed steps: the first steps after
#      admission run slower, session 17 call 2 against call 1);
#   3. budget 0.05 at 4 x 128K (5 timed steps).
source "$(dirname "$0")/prologue.sh"
{
  timeout 60 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 30 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -8
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16
        --profile conservative,bench/profiles/tiny-retrieval-16k.json)
timeout 230 "$bin/fluxion" bench decode "${common[@]}" --contexts 32768,131072 --batch 1 \
  --budget 0.05,0.02 --steps 8 --policy fixed_32_0.05,fixed_32_0.02,lfps,fluxion \
  --host-memory-gib 40 --json "$out/s17-8b-b1-final.json" 2>&1 | tee "$out/s17-8b-b1-final.log"
timeout 250 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 4 \
  --budget 0.05 --steps 5 --policy fixed_32_0.05,fixed_32_0.02,lfps,fluxion \
  --host-memory-gib 84 --json "$out/s17-8b-128k-b4-final.json" 2>&1 | tee "$out/s17-8b-128k-b4-final.log"
tar -C "$out" -cJf /tmp/session17-call3.tar.xz . && rm -rf "$out"/* && mv /tmp/session17-call3.tar.xz "$out/"
