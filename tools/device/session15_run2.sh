#!/usr/bin/env bash
# Session 15, device call 2: the rows call 1's timeouts cut, same bundle: 4 x 128K under the
# conservative profile and 1 x 128K under the measured one, the fixed hybrids against lfps /
# fluxion exact and capped (C = 4, 2).
source "$(dirname "$0")/prologue.sh"
common=(--device cuda --preset llama3.1-8b --budget 0.05 --device-read-share 0.5 --steps 3
        --cpu-threads 16)
timeout 330 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 4 \
  --host-memory-gib 84 --profile conservative \
  --policy fixed_32_0.05,fixed_32_0.02,lfps,lfps_cap2,fluxion,fluxion_cap2 \
  --json "$out/cap-8b-128k-b4.json" 2>&1 | tee "$out/cap-8b-128k-b4.log"
timeout 150 "$bin/fluxion" bench decode "${common[@]}" --contexts 131072 --batch 1 \
  --host-memory-gib 40 --policy lfps,lfps_cap4,lfps_cap2,fluxion,fluxion_cap4,fluxion_cap2 \
  --profile bench/profiles/tiny-retrieval-16k.json \
  --json "$out/cap-8b-measured-128k.json" 2>&1 | tee "$out/cap-8b-measured-128k.log"
tar -C "$out" -cJf /tmp/session15-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session15-call2.tar.xz "$out/"
