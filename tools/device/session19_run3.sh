#!/usr/bin/env bash
# Session 19, device call 3: the hybrid step observes in the finish phase when the layer's
# selections fill the pool (HybridBatchAttention::ObserveInFinish), and LFPS / exact_topk take
# their top-k's first pass in tasks (TopKIndicesInTasks); `fluxion` is this tree, `fluxion_s19a`
# 72fe075 (call 1's). Tests first, then 4 x 128K and 1 x 128K at budget 0.05, both binaries.
source "$(dirname "$0")/prologue.sh"
{
  timeout 60 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 60 "$bin/step_executor_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -4
  timeout 120 "$bin/decode_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -4
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16 --budget 0.05
        --profile conservative,bench/profiles/tiny-retrieval-16k.json --contexts 131072
        --policy fixed_32_0.05,lfps,fluxion)
run() {  # name binary args...
  local name=$1 exe=$2; shift 2
  timeout 170 "$bin/$exe" bench decode "${common[@]}" "$@" --json "$out/s19-$name.json" 2>&1 |
    tee "$out/s19-$name.log"
}
b4=(--batch 4 --steps 4 --host-memory-gib 84)
b1=(--batch 1 --steps 8 --host-memory-gib 40)
run 8b-128k-b4-c3new fluxion "${b4[@]}"
run 8b-128k-b4-c3s19a fluxion_s19a "${b4[@]}"
run 8b-128k-b1-c3new fluxion "${b1[@]}"
run 8b-128k-b1-c3s19a fluxion_s19a "${b1[@]}"
tar -C "$out" -cJf /tmp/session19-call3.tar.xz . && rm -rf "$out"/* && mv /tmp/session19-call3.tar.xz "$out/"
