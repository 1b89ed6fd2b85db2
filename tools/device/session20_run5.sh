#!/usr/bin/env bash
# Session 20, device call 5: the ping-pong executor's CPU phases served by the thread that called Step
# (decode/cpu_lane.h: the caller's one OpenMP team; call 4's lane thread of its own made a second team and slowed every row). `fluxion` is this tree,
# `fluxion_d79` d79a6dd (call 1's: the lane a FIFO lock the drivers took in turn).
#   1. tests: cuda_resident_window_test (ping-pong against one pipeline on the GPU),
#      eval_cuda_test;
#   2. fixed_32_0.05 / fixed_32_0.02, one pipeline and ping-pong, 4 x 32K, 16 x 32K, 4 x 128K:
#      new, d79, new (the machine drifts between runs).
source "$(dirname "$0")/prologue.sh"
{
  timeout 240 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -8
  timeout 90 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16
        --policy fixed_32_0.05,fixed_32_0.02 --micro-batches 1,2 --steps 8 --host-memory-gib 84
        --contexts 32768,131072 --batch 4,16)
run() {  # name binary
  timeout 150 "$bin/$2" bench decode "${common[@]}" --json "$out/s20-$1.json" 2>&1 |
    tee "$out/s20-$1.log"
}
run lane-new fluxion
run lane-d79 fluxion_d79
run lane-new2 fluxion
tar -C "$out" -cJf /tmp/session20-call5.tar.xz . && rm -rf "$out"/* && mv /tmp/session20-call5.tar.xz "$out/"
