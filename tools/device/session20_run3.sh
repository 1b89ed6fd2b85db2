#!/usr/bin/env bash
# Session 20, device call 3 (binary of call 1: d79a6dd). Calls 1-2 showed ping-pong rows with
# erratic lane waits (up to 30 ms a step) and CPU phases that doubled between runs: suspected
# oversubscription. Each driver thread of the ping-pong executor starts its own OpenMP team
# (libgomp keeps one per initial thread), so 2 x 15 workers + 2 drivers share 16 cores, the idle
# team's workers spin after their region while the other team runs, and a driver waiting for its
# stream spins in cudaStreamSynchronize. Rows: the default; 14 pool threads (a core per driver);
# OMP_WAIT_POLICY=passive (idle workers sleep at once). fixed_32_0.02 / 0.05 at 4 x 32K,
# 16 x 32K and 4 x 128K.
source "$(dirname "$0")/prologue.sh"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --policy fixed_32_0.05,fixed_32_0.02
        --steps 8 --host-memory-gib 84 --contexts 32768,131072 --batch 4,16)
run() {  # name args...
  local name=$1; shift
  timeout 190 "$bin/fluxion" bench decode "${common[@]}" "$@" --json "$out/s20-$name.json" 2>&1 |
    tee "$out/s20-$name.log"
}
run pp-default --micro-batches 1,2 --cpu-threads 16
run pp-threads14 --micro-batches 1,2 --cpu-threads 14
export OMP_WAIT_POLICY=passive
run pp-passive --micro-batches 1,2 --cpu-threads 16
unset OMP_WAIT_POLICY
tar -C "$out" -cJf /tmp/session20-call3.tar.xz . && rm -rf "$out"/* && mv /tmp/session20-call3.tar.xz "$out/"
