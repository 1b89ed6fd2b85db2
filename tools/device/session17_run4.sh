#!/usr/bin/env bash
# Session 17, device call 4: (1) eval_cuda_test now includes fluxion with the error guard (its
# exact checks read each layer's output back from the device: first run of that path on a GPU);
# (2) lfps / fluxion at 1 x 128K and 4 x 128K, budget 0.05, after the table pass went to fp32
# images only (commit after bf26177), against fixed_32_0.05 in the same run.
source "$(dirname "$0")/prologue.sh"
{
  timeout 90 "$bin/eval_cuda_test" 2>&1 | grep -E 'identical|^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure|Expected|Which is|actual' | tail -30
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16 --budget 0.05
        --profile conservative,bench/profiles/tiny-retrieval-16k.json
        --policy fixed_32_0.05,lfps,fluxion --contexts 131072)
timeout 150 "$bin/fluxion" bench decode "${common[@]}" --batch 1 --steps 8 --host-memory-gib 40 \
  --json "$out/s17-8b-128k-b1-fp32pass.json" 2>&1 | tee "$out/s17-8b-128k-b1-fp32pass.log"
timeout 220 "$bin/fluxion" bench decode "${common[@]}" --batch 4 --steps 5 --host-memory-gib 84 \
  --json "$out/s17-8b-128k-b4-fp32pass.json" 2>&1 | tee "$out/s17-8b-128k-b4-fp32pass.log"
tar -C "$out" -cJf /tmp/session17-call4.tar.xz . && rm -rf "$out"/* && mv /tmp/session17-call4.tar.xz "$out/"
