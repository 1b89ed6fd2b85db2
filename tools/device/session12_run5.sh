#!/usr/bin/env bash
# Session 12, device call 5: the device tests on main after the helpers' merges (the error guard
# touches the hybrid step; off by default), and a serving smoke through the hybrid executor.
source "$(dirname "$0")/prologue.sh"
{
  timeout 60 "$bin/kernels_cuda_ring_test" 2>&1 | tail -3
  timeout 150 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
  timeout 200 "$bin/model_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED) |^\[==========\]|Failure' | tail -6
  timeout 150 "$bin/eval_cuda_test" 2>&1 | tail -10
} 2>&1 | tee "$out/tests.log"
tar -C "$out" -cJf /tmp/session12-call5.tar.xz . && rm -rf "$out"/* && mv /tmp/session12-call5.tar.xz "$out/"
