#!/usr/bin/env bash
# Session 23, device call 2 (session 21-22 plan): issue 14's table at one tree, part 2 (same binaries as call 1).
#   1. Llama-3.1-8B shapes at 64K x 1, 4, 8 and 128K x 1, 4 (16 x 64K and 8 / 16 x 128K do not
#      fit host memory), the same rows as call 1;
#   2. the CPU part alone (zero-copy share 0) for the fixed hybrids at 1 x 128K and 4 x 32K:
#      its GB/s against the read probe without the device's reads beside it;
#   3. ping-pong against one pipeline at 16 x 32K (after the lane fix 16f62f6 and the landing on
#      a transient thread, neither measured in session 20);
#   4. Qwen2.5-7B shapes, 32K and 128K x 1, 4, conservative profile.
source "$(dirname "$0")/prologue.sh"
common=(--device cuda --budget 0.05 --steps 4 --cpu-threads 16 --host-memory-gib 84)
timeout 250 "$bin/fluxion" bench decode "${common[@]}" --preset llama3.1-8b --device-read-share 0.5 \
  --policy full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05,lfps,fluxion \
  --profile conservative,bench/profiles/tiny-retrieval-16k.json \
  --contexts 65536,131072 --batch 1,4,8 --json "$out/s23-8b-64k-128k.json" 2>&1 |
  tee "$out/s23-8b-64k-128k.log"
timeout 60 "$bin/fluxion" bench decode "${common[@]}" --preset llama3.1-8b --device-read-share 0 \
  --policy fixed_32_0.05,fixed_32_0.02,fixed_16_0.05 --contexts 32768,131072 --batch 1,4 \
  --host-memory-gib 40 --json "$out/s23-8b-cpu-alone.json" 2>&1 | tee "$out/s23-8b-cpu-alone.log"
timeout 70 "$bin/fluxion" bench decode "${common[@]}" --preset llama3.1-8b --device-read-share 0.5 \
  --policy fixed_32_0.05,fixed_32_0.02 --micro-batches 1,2 --contexts 32768 --batch 16 \
  --json "$out/s23-8b-pingpong.json" 2>&1 | tee "$out/s23-8b-pingpong.log"
timeout 130 "$bin/fluxion" bench decode "${common[@]}" --preset qwen2.5-7b --device-read-share 0.5 \
  --policy full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05,lfps,fluxion --profile conservative \
  --contexts 32768,131072 --batch 1,4 --json "$out/s23-qwen7b.json" 2>&1 | tee "$out/s23-qwen7b.log"
tar -C "$out" -cJf /tmp/session23-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session23-call2.tar.xz "$out/"
