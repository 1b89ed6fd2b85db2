#!/usr/bin/env bash
# Device call for the CUDA dense backend (issue 14, CudaDenseOps): its correctness tests, the
# kernels' tests, `fluxion generate --device cuda` against the CPU on a random tiny model, then
# `fluxion bench gpu` with the whole-model dense step at Llama-3.1-8B shapes. Build and bundle
# here first:
#   cmake --build build --target fluxion kernels_cuda_test model_cuda_test
#   ../shared/device/bundle.sh .device build/fluxion build/kernels/cuda/kernels_cuda_test \
#       build/model/model_cuda_test
#   tar -cJf .device.tar.xz .device        (~76 MiB -> ~16 MiB: the tree must stay under 64 MiB)
# then run with carry [".device.tar.xz"].
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
{
  echo "== model_cuda_test"; "$bin/model_cuda_test" 2>&1 | tail -40
  echo "== kernels_cuda_test"; "$bin/kernels_cuda_test" 2>&1 | tail -40
  echo "== fluxion generate --device cuda vs cpu (random tiny model)"
  "$bin/fluxion" make-model --preset tiny --out /tmp/tiny --seed 3
  "$bin/fluxion" generate --model /tmp/tiny --prompt-ids 1,5,9,13,17 --max-tokens 24 --device cuda
  "$bin/fluxion" generate --model /tmp/tiny --prompt-ids 1,5,9,13,17 --max-tokens 24 --device cpu
  echo "== fluxion bench gpu (with the dense step)"
  "$bin/fluxion" bench gpu --batch 1,4,8,16 --contexts 32768 --read-fraction 0.05 --repeats 20 \
    --host-gib 4 --json "$out/gpu-bench.json"
} 2>&1 | tee "$out/log.txt"
ls -la "$out"
