#!/usr/bin/env bash
# Session 20, device call 6 (the last 284 s of the session's budget): admissions inside a
# ping-pong step and the guard's checks go through the CPU lane as well, so no driver thread
# starts a parallel region (decode/cpu_lane.h). One sweep: if the one-pipeline rows after the
# ping-pong rows keep their plan time (4 x 128K resident-only plan ~0.9 ms, as in a process that
# ran no ping-pong row, call 1), the second OpenMP team was what slowed them.
source "$(dirname "$0")/prologue.sh"
{
  timeout 60 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -8
  timeout 60 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
} 2>&1 | tee "$out/tests.log"
timeout 140 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b --device-read-share 0.5 \
  --cpu-threads 16 --policy fixed_32_0.05,fixed_32_0.02 --micro-batches 1,2 --steps 8 \
  --host-memory-gib 84 --contexts 32768,131072 --batch 4,16 --json "$out/s20-lane-serve-all.json" 2>&1 |
  tee "$out/s20-lane-serve-all.log"
tar -C "$out" -cJf /tmp/session20-call6.tar.xz . && rm -rf "$out"/* && mv /tmp/session20-call6.tar.xz "$out/"
