#!/usr/bin/env bash
# Session 17, device call 1: LFPS / Fluxion at Llama-3.1-8B shapes, KV in host memory, after the
# decision profiles learned the trained model's candidate volume (`rescored_share`, replayed by
# thinning the candidates: docs/SPARSE.md, "Decision profiles") and the table clamps select in
# place (lfps_tables.cc):
#   1. device tests of the hybrid path (eval_cuda_test: the hybrid step's outcomes equal the CPU
#      path's; cuda_resident_window_test);
#   2. `bench decode --device cuda`, budget 0.05: fixed_32_0.05 against lfps / fluxion under the
#      conservative profile (random tables' candidates) and the measured one
#      (tiny-retrieval-16k, now with rescored_share), 1 x 32K, 1 x 128K, 4 x 128K.
source "$(dirname "$0")/prologue.sh"
{
  timeout 90 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 60 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -8
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --device-read-share 0.5 --steps 3
        --cpu-threads 16 --policy fixed_32_0.05,lfps,fluxion
        --profile conservative,bench/profiles/tiny-retrieval-16k.json)
timeout 200 "$bin/fluxion" bench decode "${common[@]}" --contexts 32768,131072 --batch 1 \
  --host-memory-gib 40 --json "$out/s17-8b-b1.json" 2>&1 | tee "$out/s17-8b-b1.log"
timeout 220 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 4 \
  --host-memory-gib 84 --json "$out/s17-8b-128k-b4.json" 2>&1 | tee "$out/s17-8b-128k-b4.log"
tar -C "$out" -cJf /tmp/session17-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session17-call1.tar.xz "$out/"
