#!/usr/bin/env bash
# Session 20, device call 1: the zero-copy reads of host pages on a lowest-priority stream of the
# window's own, the dense ops' streams at the highest (decode/cuda_resident_window.cc Init says
# why), for the ping-pong executor (EXECUTOR.md section 8: at the same priority the reads' blocks
# held the SMs while the other half's dense kernels waited). `fluxion` is this tree,
# `fluxion_s19` f34685c (one stream, default priority).
#   1. tests: cuda_resident_window_test (the window, zero-copy, ping-pong against one pipeline),
#      eval_cuda_test (the hybrid step's outcomes equal the CPU path's);
#   2. fixed_32_0.05 / fixed_32_0.02, one pipeline and ping-pong, 4 x 32K, 16 x 32K, 4 x 128K,
#      both binaries.
source "$(dirname "$0")/prologue.sh"
{
  timeout 240 "$bin/cuda_resident_window_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure' | tail -8
  timeout 90 "$bin/eval_cuda_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure' | tail -20
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16
        --policy fixed_32_0.05,fixed_32_0.02 --micro-batches 1,2 --steps 6 --host-memory-gib 84)
run() {  # name binary args...
  local name=$1 exe=$2; shift 2
  timeout 200 "$bin/$exe" bench decode "${common[@]}" "$@" --json "$out/s20-$name.json" 2>&1 |
    tee "$out/s20-$name.log"
}
run 8b-32k-new fluxion --contexts 32768 --batch 4,16
run 8b-32k-s19 fluxion_s19 --contexts 32768 --batch 4,16
run 8b-128k-b4-new fluxion --contexts 131072 --batch 4
run 8b-128k-b4-s19 fluxion_s19 --contexts 131072 --batch 4
tar -C "$out" -cJf /tmp/session20-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session20-call1.tar.xz "$out/"
