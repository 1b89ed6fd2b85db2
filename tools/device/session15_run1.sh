#!/usr/bin/env bash
# Session 15, device call 1: the capped rescoring of lfps / fluxion (PolicyConfig::rescore_cap,
# the `_cap<C>` policy names; lfps_policy.h) at Llama-3.1-8B shapes, KV in host memory:
#   1. device tests of the hybrid path (eval_cuda_test: the hybrid step's outcomes equal the CPU
#      path's, cuda_resident_window_test: the device's page scores);
#   2. `bench decode --device cuda`: the fixed hybrids against lfps / fluxion exact and capped
#      (C = 4, 2), conservative profile, 1 x 32K, 4 x 32K, 1 x 128K, 4 x 128K; then the measured
#      profile of the trained model (tiny-retrieval-16k) at 1 x 32K and 1 x 128K.
source "$(dirname "$0")/prologue.sh"
{
  timeout 90 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 60 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -8
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --device-read-share 0.5 --steps 3
        --cpu-threads 16)
policies=fixed_32_0.05,fixed_32_0.02,lfps,lfps_cap4,lfps_cap2,fluxion,fluxion_cap4,fluxion_cap2
timeout 110 "$bin/fluxion" bench decode "${common[@]}" --contexts 32768 --batch 1,4 \
  --host-memory-gib 40 --policy "$policies" --profile conservative \
  --json "$out/cap-8b-32k.json" 2>&1 | tee "$out/cap-8b-32k.log"
timeout 200 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 1,4 \
  --host-memory-gib 84 --policy "$policies" --profile conservative \
  --json "$out/cap-8b-128k.json" 2>&1 | tee "$out/cap-8b-128k.log"
timeout 90 "$bin/fluxion" bench decode "${common[@]}" --contexts 32768,131072 --batch 1 \
  --host-memory-gib 40 --policy lfps,lfps_cap4,lfps_cap2,fluxion,fluxion_cap4,fluxion_cap2 \
  --profile bench/profiles/tiny-retrieval-16k.json \
  --json "$out/cap-8b-measured.json" 2>&1 | tee "$out/cap-8b-measured.log"
tar -C "$out" -cJf /tmp/session15-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session15-call1.tar.xz "$out/"
