#!/usr/bin/env bash
# Session 17, device call 6: what block-granular LFPS tables (`lfps_b16`: one table entry per
# 16 tokens, candidates the selected blocks and their neighbours, rescored exactly) save at
# Llama-3.1-8B shapes against token-level `lfps`, conservative profile (random tables), budget
# 0.05, fixed_32_0.05 in the same run. A speed question only: on the trained model's calibration
# seeds lfps_b16 lost answers (bench/results "session 17").
source "$(dirname "$0")/prologue.sh"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16 --budget 0.05
        --profile conservative --policy fixed_32_0.05,lfps,lfps_b16 --contexts 131072)
timeout 100 "$bin/fluxion" bench decode "${common[@]}" --batch 1 --steps 8 --host-memory-gib 40 \
  --json "$out/s17-8b-128k-b1-blocktables.json" 2>&1 | tee "$out/s17-8b-128k-b1-blocktables.log"
timeout 150 "$bin/fluxion" bench decode "${common[@]}" --batch 4 --steps 4 --host-memory-gib 84 \
  --json "$out/s17-8b-128k-b4-blocktables.json" 2>&1 | tee "$out/s17-8b-128k-b4-blocktables.log"
tar -C "$out" -cJf /tmp/session17-call6.tar.xz . && rm -rf "$out"/* && mv /tmp/session17-call6.tar.xz "$out/"
