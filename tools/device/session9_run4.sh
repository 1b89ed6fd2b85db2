#!/usr/bin/env bash
# Session 9, device call 4: the rest of the 8B table (64K x 4 and 8, 128K x 1 and 4; the fixed
# hybrids and full attention over host KV, device block scores, zero-copy share 0.5, next to the
# HBM-resident step), then Qwen2.5-7B shapes at 32K and 128K. lfps / fluxion were timed in call 3
# (32K, 64K x 1) and take 0.1-1.5 s a step at these shapes, so they are left out here.
# Bundle: /work/shared/device/bundle.sh .device build/fluxion; tar -cf - .device | xz -T2 -3 >
#   .device.tar.xz (carry it).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX
timeout 300 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --contexts 65536,131072 --batch 1,4,8 --policy full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05 \
  --device-read-share 0.5 --steps 3 --cpu-threads 16 --json "$out/hybrid-8b.json" 2>&1 \
  | tee "$out/hybrid-8b.log"
timeout 160 "$bin/fluxion" bench decode --device cuda --preset qwen2.5-7b \
  --contexts 32768,131072 --batch 1,4 --policy full,fixed_32_0.05 --device-read-share 0.5 \
  --steps 3 --cpu-threads 16 --json "$out/hybrid-qwen7b.json" 2>&1 | tee "$out/hybrid-qwen7b.log"
ls -la "$out"
