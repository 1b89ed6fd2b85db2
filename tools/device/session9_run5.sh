#!/usr/bin/env bash
# Session 9, device call 5 (short): where lfps / fluxion spend their step at 8B shapes: the K rows
# they read only to rescore candidates, per step, next to the rows attended (1 x 32K).
# Bundle: /work/shared/device/bundle.sh .device build/fluxion; tar -cf - .device | xz -T2 -3 >
#   .device.tar.xz (carry it).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
export OPENBLAS_CORETYPE=SKYLAKEX
timeout 100 /tmp/dev/.device/bin/fluxion bench decode --device cuda --preset llama3.1-8b \
  --contexts 32768 --batch 1 --policy fixed_32_0.05,lfps,fluxion --budget 0.05 \
  --profile conservative --device-read-share 0.5 --steps 3 --cpu-threads 16 \
  --json "$out/hybrid-8b.json" 2>&1 | tee "$out/hybrid-8b.log"
