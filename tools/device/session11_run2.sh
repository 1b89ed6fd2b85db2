#!/usr/bin/env bash
# Session 11, device call 2 (right after call 1, same bundle):
#   1. 1 and 4 x 128K: the fixed hybrids, lfps and fluxion (this tree), and lfps / fluxion of
#      session 10's binary at 1 x 128K (the same-call ratio);
#   2. the CPU phase's per-layer overhead: the fixed hybrids with OMP_WAIT_POLICY=active (OpenMP
#      threads spin between a layer's parallel regions instead of sleeping while the CPU waits
#      for the GPU) against the default, in one call;
#   3. dynamic degradation (--degrade-on-stall) at 4 x 32K against the same rows without it;
#   4. fluxion local --decode-device cuda (serving smoke).
source "$(dirname "$0")/prologue.sh"
# Call 1's tests.log did not come back (more files than a call returns): this test again, and
# every file of this call in one archive at the end.
timeout 100 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' \
  | tee "$out/tests-resident-window.log" | tail -3
common=(--device cuda --preset llama3.1-8b --budget 0.05 --device-read-share 0.5 --steps 3
        --cpu-threads 16)
timeout 170 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 1,4 \
  --host-memory-gib 72 --policy fixed_32_0.05,fixed_32_0.02,lfps,fluxion --profile conservative \
  --json "$out/hybrid-8b-128k.json" 2>&1 | tee "$out/hybrid-8b-128k.log"
timeout 80 "$bin/fluxion-base" bench decode "${common[@]}" --contexts 131072 --batch 1 \
  --host-memory-gib 20 --policy lfps,fluxion --profile conservative \
  --json "$out/hybrid-8b-128k-base.json" 2>&1 | tee "$out/hybrid-8b-128k-base.log"
for policy in default active; do
  env_args=()
  [[ $policy == active ]] && env_args=(OMP_WAIT_POLICY=active)
  timeout 70 env "${env_args[@]}" "$bin/fluxion" bench decode "${common[@]}" \
    --contexts 32768,131072 --batch 1,4 --host-memory-gib 72 --policy fixed_32_0.05,fixed_32_0.02 \
    --json "$out/hybrid-8b-wait-$policy.json" 2>&1 | tee "$out/hybrid-8b-wait-$policy.log"
done
timeout 70 "$bin/fluxion" bench decode "${common[@]}" --contexts 32768 --batch 4 \
  --host-memory-gib 24 --policy fixed_32_0.05,lfps --profile conservative --degrade-on-stall \
  --json "$out/hybrid-8b-degrade.json" 2>&1 | tee "$out/hybrid-8b-degrade.log"
echo "== fluxion local --decode-device cuda" | tee "$out/local.log"
timeout 60 "$bin/fluxion" local --model models/fluxion-tiny-retrieval --decode-device cuda \
  --cpu-threads 4 --max-requests 24 --out-dir "$out/local-cuda" --json "$out/local-cuda.json" \
  2>&1 | tail -20 | tee -a "$out/local.log"
rm -rf "$out/local-cuda"
tar -C "$out" -cJf /tmp/session11-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session11-call2.tar.xz "$out/"
