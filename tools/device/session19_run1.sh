#!/usr/bin/env bash
# Session 19, device call 1, at Llama-3.1-8B shapes on the H200 machine, three binaries in one
# call (the machine drifts; the two runs of the newest bound it):
#   fluxion      this session: LFPS rescores its candidates in tasks that build their own spans
#                and take the group's max (ScorePositionsInTasks), picks ordered by a bitmap
#   fluxion_s18  a9e051d: session 18's deferred observation and step-ahead table picks
#   fluxion_s17  06eafe5: session 17's tree, before both
# (session 18's own call compared the last two; its files were lost with that session.)
#   1. tests: eval_cuda_test (the hybrid step's outcomes equal the CPU path's),
#      the executors, the deferred-observation and rescoring-in-tasks tests;
#   2. 1 x 128K at budget 0.05, conservative and measured profiles, fixed_32_0.05 in each run:
#      new, s18, s17, new again.
source "$(dirname "$0")/prologue.sh"
{
  timeout 60 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  for t in step_executor_test ping_pong_step_executor_test; do
    timeout 60 "$bin/$t" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -4
  done
  timeout 120 "$bin/decode_test" --gtest_filter='SparseAttentionTest.*:ScorePositionsInTasksTest.*:Lfps*:Fluxion*:PolicyBudgetScaleTest.*' 2>&1 |
    grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -6
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16 --budget 0.05
        --profile conservative,bench/profiles/tiny-retrieval-16k.json --contexts 131072
        --batch 1 --steps 8 --host-memory-gib 40 --policy fixed_32_0.05,lfps,fluxion)
run() {  # name binary
  timeout 120 "$bin/$2" bench decode "${common[@]}" --json "$out/s19-$1.json" 2>&1 |
    tee "$out/s19-$1.log"
}
run 8b-128k-b1-new fluxion
run 8b-128k-b1-s18 fluxion_s18
run 8b-128k-b1-s17 fluxion_s17
run 8b-128k-b1-new2 fluxion
tar -C "$out" -cJf /tmp/session19-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session19-call1.tar.xz "$out/"
