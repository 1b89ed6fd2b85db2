#!/usr/bin/env bash
# Session 10, device call 1: lfps / fluxion at Llama-3.1-8B shapes after their 8B mechanics work
# (fluxion per KV head in parallel and scored from the device's page scores; LFPS's table clamp by
# radix select; Observe reusing Select's logits), beside the fixed hybrids in the same run.
# Bundle: /work/shared/device/bundle.sh .device build/fluxion; tar -cf - .device | xz -T2 -3 >
#   .device.tar.xz (carry it).
source "$(dirname "$0")/prologue.sh"
fluxion="$bin/fluxion"
timeout 260 "$fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 32768 --batch 1,4,16 --policy fixed_32_0.05,fixed_32_0.02,lfps,fluxion \
  --budget 0.05,0.02 --profile conservative,bench/profiles/tiny-retrieval-16k.json \
  --device-read-share 0.5 --steps 3 --cpu-threads 16 \
  --json "$out/hybrid-8b-32k.json" 2>&1 | tee "$out/hybrid-8b-32k.log"
timeout 290 "$fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 131072 --batch 1,4 --policy fixed_32_0.05,fixed_32_0.02,lfps,fluxion \
  --budget 0.05,0.02 --profile conservative --device-read-share 0.5 --steps 3 --cpu-threads 16 \
  --json "$out/hybrid-8b-128k.json" 2>&1 | tee "$out/hybrid-8b-128k.log"
