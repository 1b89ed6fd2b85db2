#!/usr/bin/env bash
# Session 11, device call 4: LFPS Observe as tasks (this tree) against 5f8f8cc (`fluxion-base`:
# the same code before that change), same call: lfps / fluxion at 1 x 32K and 1 x 128K.
source "$(dirname "$0")/prologue.sh"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --device-read-share 0.5 --steps 3
        --cpu-threads 16 --policy lfps,fluxion --profile conservative)
for b in fluxion fluxion-base; do
  timeout 110 "$bin/$b" bench decode "${common[@]}" --contexts 32768,131072 --batch 1 \
    --host-memory-gib 24 --json "$out/observe-$b.json" 2>&1 | tee "$out/observe-$b.log"
done
tar -C "$out" -cJf /tmp/session11-call4.tar.xz . && rm -rf "$out"/* && mv /tmp/session11-call4.tar.xz "$out/"
