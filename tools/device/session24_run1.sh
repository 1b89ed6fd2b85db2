#!/usr/bin/env bash
# Session 24, device call 1 (planned in session 23; ~8 min):
#   1. prefill_device_test: the batch test's near-tie revision (session 23 ran the one before it);
#   2. issue 14's missing rows: Llama-3.1-8B shapes at 128K x 1, 4, zero-copy share 0.5, every
#      policy and both profiles (session 23's call 2 timed out before them);
#   3. issue 15: where a 512-token request's TTFT goes (the `engine` column), UCX over TCP and over
#      shared memory, batch 1 and 4.
source "$(dirname "$0")/prologue.sh"
run_test 150 prefill_device_test 2>&1 | tee "$out/tests-prefill.log"
timeout 260 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b --budget 0.05 \
  --device-read-share 0.5 --steps 4 --cpu-threads 16 --host-memory-gib 84 \
  --policy full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05,lfps,fluxion \
  --profile conservative,bench/profiles/tiny-retrieval-16k.json \
  --contexts 131072 --batch 1,4 --json "$out/s24-8b-128k.json" 2>&1 | tee "$out/s24-8b-128k.log"
for link in tcp sm; do
  if [[ $link == tcp ]]; then ucx=(--ucx-tls tcp --ucx-net-devices lo)
  else ucx=(--ucx-tls sm,self --noucx-peer-error-handling); fi
  timeout 60 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b --contexts 512 \
    --batch 1,4 --send layerwise,after --repeats 3 --policy fixed_32_0.05 "${ucx[@]}" \
    --json "$out/s24-prefill-512-$link.json" 2>&1 | grep -v "^W2026\|^WARNING" |
    tee "$out/s24-prefill-512-$link.log"
done
# 4. The opt-in bf16 dot-product kernels against the fp32 ones on the Xeon (docs/KV_LAYOUT.md: the
#    default changes only on a clear gain there; on the devbox's Zen 4 they tied, session 23).
for isa in avx512 avx512bf16; do
  FLUXION_CPU_ISA=$isa timeout 60 "$bin/fluxion" bench attention --contexts 32768,131072 \
    --cpu-threads 1,16 --policy full,fixed_32_0.05 --repeats 40 --group 4 --head-dim 128 \
    --json "$out/s24-attention-isa-$isa.json" 2>&1 | tee "$out/s24-attention-isa-$isa.log"
done
