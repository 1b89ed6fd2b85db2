#!/usr/bin/env bash
# Session 7 device call: correctness of the CUDA decode kernels first, then their timings at
# Llama-3.1-8B shapes (`fluxion bench gpu`), the torch HBM-resident whole-step anchor in the same
# run, and the HF tokenizer references for issue 16. Build and bundle here first:
#   cmake --build build --target fluxion kernels_cuda_test
#   ../shared/device/bundle.sh .device build/fluxion build/kernels/cuda/kernels_cuda_test
#   tar -cJf .device.tar.xz .device        (73 MiB -> ~22 MiB: the tree must stay under 64 MiB)
# then run with carry [".device.tar.xz"].
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out/tok" /tmp/dev
tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
{
  echo "== kernels_cuda_test"; "$bin/kernels_cuda_test" 2>&1 | tail -40
  echo "== fluxion bench gpu"
  "$bin/fluxion" bench gpu --batch 1,4,16 --contexts 32768,65536,131072 \
    --read-fraction 0.05,0.02 --repeats 20 --json "$out/gpu-bench.json"
  echo "== anchor_hbm_decode.py"
  python3 bench/anchor_hbm_decode.py --json "$out/anchor-hbm.json" 2>&1 | tail -20
  echo "== tokenizer references"
  python3 tools/hf_reference/make_tokenizer_refs.py "$out/tok" 2>&1 | tail -5
} 2>&1 | tee "$out/log.txt"
tar -C "$out" -czf "$out/tok.tar.gz" tok && rm -rf "$out/tok"
ls -la "$out"
