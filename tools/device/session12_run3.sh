#!/usr/bin/env bash
# Session 12, device call 3: off-step admission at the lowest CPU priority (nice 19; call 2 ran
# it at normal priority and the steps beside it took 3-5x their time). --join: one more request
# admitted off the step while the batch steps on: 32K at batch 4, 128K at batch 1.
source "$(dirname "$0")/prologue.sh"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --steps 5 --cpu-threads 16
        --device-read-share 0.5 --policy fixed_32_0.05,fixed_32_0.02 --join)
timeout 80 "$bin/fluxion" bench decode "${common[@]}" --contexts 32768 --batch 4,8 \
  --host-memory-gib 40 --json "$out/join-32k.json" 2>&1 | tee "$out/join-32k.log"
timeout 150 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 1,2 \
  --host-memory-gib 40 --json "$out/join-128k.json" 2>&1 | tee "$out/join-128k.log"
tar -C "$out" -cJf /tmp/session12-call3.tar.xz . && rm -rf "$out"/* && mv /tmp/session12-call3.tar.xz "$out/"
