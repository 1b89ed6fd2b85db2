#!/usr/bin/env bash
# Device call 3 of session 2 (Xeon, quiet CPU): the attention bench of the AVX-512 build for every policy at 1 and 16 threads (issues 4 and 5),
# then a bounded 16K paired task evaluation of the v2 model (the devbox cannot run 16K).
# Bundle: build/fluxion (72 MB with the service libraries: over the 64 MiB carry limit, so it
# travels as .device.tar.xz, 15 MB: `tar -cJf .device.tar.xz .device`); carry [".device.tar.xz"].
set -uo pipefail
[ -d .device ] || tar -xJf .device.tar.xz
source .device/env.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
export FLUXION_SOURCE_DIR=$PWD
lscpu > "$out/lscpu.txt"
timeout 200 fluxion bench attention --contexts 4096,16384,65536,131072 --threads 1,16 --repeats 10 \
  --policy full,exact_topk,quest,lfps,lfps_paper,fluxion,fixed_32_0.05 --budget 0.02,0.05 \
  --json "$out/attention-xeon.json" > "$out/bench-attention-xeon.txt" 2>&1
tail -45 "$out/bench-attention-xeon.txt"
timeout 270 fluxion eval tasks --model models/fluxion-tiny-retrieval --tasks niah_multikey,aggregate \
  --contexts 16384 --samples 10 --policy full,exact_topk,quest,lfps,lfps_paper,fluxion --budget 0.02 \
  --json "$out/eval-tasks-16k-xeon.json" > "$out/eval-tasks-16k-xeon.txt" 2>&1
tail -15 "$out/eval-tasks-16k-xeon.txt"
