#!/usr/bin/env bash
# Session 18, device call 1: the hybrid step's deferred observation and LFPS's step-ahead table
# picks (0694aaf) at Llama-3.1-8B shapes, against session 17's binary (06eafe5, `fluxion_s17`)
# in the same call, each with fixed_32_0.05 in its own run:
#   1. eval_cuda_test (the hybrid step's outcomes equal the CPU path's), the CUDA window, the
#      executors' and the deferred-observation tests;
#   2. 1 x 128K at budget 0.05, conservative and measured profiles: new, old, new again (the
#      machine drifts; the two new runs bound it);
#   3. 4 x 128K at 0.05, new then old.
source "$(dirname "$0")/prologue.sh"
{
  timeout 60 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 30 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -8
  for t in step_executor_test ping_pong_step_executor_test; do
    timeout 60 "$bin/$t" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -4
  done
  timeout 60 "$bin/decode_test" --gtest_filter='SparseAttentionTest.*' 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -4
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16 --budget 0.05
        --profile conservative,bench/profiles/tiny-retrieval-16k.json --contexts 131072)
b1=(--batch 1 --steps 8 --host-memory-gib 40 --policy fixed_32_0.05,lfps,fluxion)
b4=(--batch 4 --steps 4 --host-memory-gib 84 --policy fixed_32_0.05,lfps,fluxion)
run() {  # name binary args...
  local name=$1 exe=$2; shift 2
  timeout "$T" "$bin/$exe" bench decode "${common[@]}" "$@" --json "$out/s18-$name.json" 2>&1 |
    tee "$out/s18-$name.log"
}
T=120 run 8b-128k-b1-new fluxion "${b1[@]}"
T=120 run 8b-128k-b1-old fluxion_s17 "${b1[@]}"
T=120 run 8b-128k-b1-new2 fluxion "${b1[@]}"
T=170 run 8b-128k-b4-new fluxion "${b4[@]}"
tar -C "$out" -cJf /tmp/session18-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session18-call1.tar.xz "$out/"
