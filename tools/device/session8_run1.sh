#!/usr/bin/env bash
# Session 8, device call 1 (issue 14 and 13): correctness first (CUDA dense ops, kernels, the CUDA
# resident window, generate --device cuda vs cpu), then the hybrid step at Llama-3.1-8B shapes
# (`fluxion bench decode --device cuda`), the dense step (`fluxion bench gpu`), and issue 13's
# batched CPU executor on the host Xeon. Build and bundle here:
#   ninja -C build fluxion kernels_cuda_test model_cuda_test cuda_resident_window_test
#   /work/shared/device/bundle.sh .device build/fluxion build/kernels/cuda/kernels_cuda_test \
#       build/model/model_cuda_test build/decode/cuda_resident_window_test
#   tar -cf - .device | xz -T2 -3 > .device.tar.xz
# then run with carry [".device.tar.xz"]. PART=all|tests|hybrid|xeon.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX  # docs/DEPENDENCIES.md: OpenBLAS's own pick is 3x slower here
part=${PART:-all}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)" > "$out/cpu.txt"
free -g > "$out/mem.txt"
if [[ $part == all || $part == tests ]]; then
  {
    for t in model_cuda_test kernels_cuda_test cuda_resident_window_test; do
      echo "== $t"; "$bin/$t" 2>&1 | grep -E "^\[ +(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|error" | tail -60
    done
    echo "== fluxion generate --device cuda vs cpu (random tiny model)"
    "$bin/fluxion" make-model --preset tiny --out /tmp/tiny --seed 3
    "$bin/fluxion" generate --model /tmp/tiny --prompt-ids 1,5,9,13,17 --max-tokens 24 --device cuda
    "$bin/fluxion" generate --model /tmp/tiny --prompt-ids 1,5,9,13,17 --max-tokens 24 --device cpu
  } 2>&1 | tee "$out/tests.log"
fi
if [[ $part == all || $part == hybrid ]]; then
  timeout 300 "$bin/fluxion" bench decode --device cuda --preset llama3.1-8b \
    --contexts 32768,131072 --batch 1,4 --policy full,fixed_32_0.05,fixed_32_0.02,fixed_16_0.05 \
    --steps 3 --cpu-threads 16 --json "$out/hybrid-8b.json" 2>&1 | tee "$out/hybrid-8b.log"
  timeout 120 "$bin/fluxion" bench gpu --batch 1,4,16 --contexts 32768 --read-fraction 0.05 \
    --repeats 10 --host-gib 4 --dense-step --json "$out/gpu-bench.json" 2>&1 | tee "$out/gpu-bench.log"
fi
if [[ $part == all || $part == xeon ]]; then
  timeout 150 "$bin/fluxion" bench decode --model models/fluxion-tiny-retrieval --contexts 16384 \
    --batch 1,4,8,16 --policy full,fluxion --budget 0.05 --cpu-threads 16 --steps 3 \
    --json "$out/decode-tiny-16k.json" 2>&1 | tee "$out/decode-tiny-16k.log"
fi
ls -la "$out"
