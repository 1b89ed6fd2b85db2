#!/usr/bin/env bash
# Session 25, after the 16K evaluation (issue 18's "Speed" item): what the online error guard
# costs per decode step, on a quiet machine (session 12's devbox numbers were too noisy for time
# shares). Guard defaults (tolerance 0.8, max weight 2, rate 1/24); every row paired with the same
# policy unguarded in the same run (`--guard both`).
#   1. bench attention: one request's heads on one Xeon core, 4K-64K (the byte and time share);
#   2. bench decode, CPU batched executor, the trained tiny model's W_O, 16 threads;
#   3. bench decode --device cuda, Llama-3.1-8B shapes: the hybrid step with the checked layers'
#      outputs copied to the host (the CUDA path's price, unmeasured until now);
#   4. the bf16 dot-product kernels against the fp32 ones on this Xeon (session 24's run of this
#      printed nothing inside its 60 s).
#   tools/device/session25_guard_cost.sh SECONDS   (stops starting steps past SECONDS)
source "$(dirname "$0")/prologue.sh"
deadline=$(( $(date +%s) + ${1:-300} ))
left() { echo $(( deadline - $(date +%s) )); }
step() {  # step NAME TIMEOUT COMMAND...: skipped once the deadline is near
  local name=$1 limit=$2 l
  shift 2
  l=$(left)
  (( l < 20 )) && { echo "== $name: skipped (${l}s left)"; return; }
  (( limit > l )) && limit=$l
  echo "== $name (${limit}s)"
  timeout "$limit" stdbuf -oL "$@" 2>&1 | grep -v "^W2026\|^WARNING" | tee "$out/$name.log"
}
step s25-attention-guard 70 "$bin/fluxion" bench attention --contexts 4096,16384,65536 \
  --cpu-threads 1 --repeats 48 --policy lfps,fluxion --budget 0.02,0.05 --guard both \
  --guard-rate 0.0416667 --pool-gib 1 --json "$out/s25-attention-guard.json"
step s25-decode-guard-cpu 50 "$bin/fluxion" bench decode --model models/fluxion-tiny-retrieval \
  --contexts 4096,16384 --batch 1,4 --policy fluxion,lfps --budget 0.02,0.05 --guard both \
  --steps 16 --cpu-threads 16 --json "$out/s25-decode-guard-cpu.json"
step s25-decode-guard-cuda 100 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
  --budget 0.05 --device-read-share 0.5 --steps 4 --cpu-threads 16 --host-memory-gib 40 \
  --policy lfps,fluxion --profile bench/profiles/tiny-retrieval-16k.json --guard both \
  --contexts 32768 --batch 1,4 --json "$out/s25-decode-guard-cuda.json"
for isa in avx512 avx512bf16; do
  export FLUXION_CPU_ISA=$isa
  step "s25-attention-isa-$isa" 90 "$bin/fluxion" bench attention \
    --contexts 32768,131072 --cpu-threads 1,16 --policy full,fixed_32_0.05 --repeats 40 \
    --group 4 --head-dim 128 --json "$out/s25-attention-isa-$isa.json"
done
unset FLUXION_CPU_ISA
