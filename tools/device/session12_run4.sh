#!/usr/bin/env bash
# Session 12, device call 4: off-step admission on one plain thread at normal priority (call 2:
# four threads, call 3: nice 19; both slowed the steps beside it), with the step's team at 16
# threads (every core) and at 15 (a core left to the admission). --join at 4 x 32K.
source "$(dirname "$0")/prologue.sh"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --steps 3 --device-read-share 0.5
        --policy fixed_32_0.02,fixed_32_0.05 --join --contexts 32768 --batch 4,5 --host-memory-gib 40)
for t in 16 15; do
  timeout 100 "$bin/fluxion" bench decode "${common[@]}" --cpu-threads $t \
    --json "$out/join-32k-t$t.json" 2>&1 | tee "$out/join-32k-t$t.log"
done
tar -C "$out" -cJf /tmp/session12-call4.tar.xz . && rm -rf "$out"/* && mv /tmp/session12-call4.tar.xz "$out/"
