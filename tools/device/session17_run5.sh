#!/usr/bin/env bash
# Session 17, device call 5: eval_cuda_test again, now that its fluxion+guard run gets the
# model's output projection (call 4's failed before any step: the eval refused the guard label
# without it, on the CPU reference run as on the device one).
source "$(dirname "$0")/prologue.sh"
{
  timeout 90 "$bin/eval_cuda_test" 2>&1 | grep -E 'identical|^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure|Expected|Which is|actual|guard' | tail -30
} 2>&1 | tee "$out/tests.log"
