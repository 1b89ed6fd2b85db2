#!/usr/bin/env bash
# Session 23, device call 1 (session 21-22 plan; not run then: no machine started): issue 14's table at one tree, part 1.
#   1. every CUDA test binary (the log "Done means" asks for);
#   2. torch's HBM-resident whole step (bench/anchor_hbm_decode.py) at every point of the table;
#   3. `bench decode --device cuda` at Llama-3.1-8B shapes, 32K x batch 1, 4, 8, 16: the HBM
#      reference, the resident-only step, full attention over host KV, the three fixed hybrids,
#      lfps and fluxion under the conservative and the measured profile, budget 0.05, zero-copy
#      share 0.5; a read probe and the CPU attention's GB/s per row.
source "$(dirname "$0")/prologue.sh"
run_cuda_tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 bench/anchor_hbm_decode.py --json "$out/torch-hbm.json" 2>&1 | tail -14 |
  tee "$out/torch-hbm.log"
timeout 240 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b --budget 0.05 \
  --device-read-share 0.5 --steps 4 --cpu-threads 16 --host-memory-gib 84 \
  --policy full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05,lfps,fluxion \
  --profile conservative,bench/profiles/tiny-retrieval-16k.json \
  --contexts 32768 --batch 1,4,8,16 --json "$out/s23-8b-32k.json" 2>&1 | tee "$out/s23-8b-32k.log"
tar -C "$out" -cJf /tmp/session23-call1.tar.xz . && rm -rf "$out"/* && mv /tmp/session23-call1.tar.xz "$out/"
