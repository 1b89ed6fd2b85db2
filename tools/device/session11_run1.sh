#!/usr/bin/env bash
# Session 11, device call 1 (call 2 follows at once, on the still-warm machine):
#   1. every CUDA test binary of this tree (correctness first);
#   2. lfps / fluxion at 8B shapes, 1 and 4 x 32K, this tree's binary against session 10's
#      (ea2aaca, carried as fluxion-base) in the same call: the ratio isolates the head-step tasks
#      (RunAsTasks) and the bitmap-ordered table picks; the fixed hybrids beside them; both the
#      conservative and the measured (tiny-retrieval-16k) profile;
#   3. quality through the hybrid path: eval tasks --device cpu vs --device cuda, eval compare.
# Bundle: /work/shared/device/bundle.sh .device build/fluxion /work/wt/base/build/fluxion-base
#   build/decode/cuda_resident_window_test build/kernels/cuda/kernels_cuda_test
#   build/model/model_cuda_test build/tests/eval_cuda_test; tar -cf - .device | xz -T2 -3 >
#   .device.tar.xz (carry it).
source "$(dirname "$0")/prologue.sh"
summary='^\[ +(FAILED|PASSED|SKIPPED|OK) |^\[==========\]|Failure|Expected|Which is|gemm choice'
{
  for t in cuda_resident_window_test kernels_cuda_test model_cuda_test; do
    echo "== $t"
    timeout 100 "$bin/$t" 2>&1 | grep -E "$summary" | tail -60
  done
  echo "== eval_cuda_test"
  timeout 100 "$bin/eval_cuda_test" 2>&1 | tail -20
} 2>&1 | tee "$out/tests.log"
common=(--device cuda --preset llama3.1-8b --contexts 32768 --batch 1,4 --budget 0.05
        --device-read-share 0.5 --steps 3 --cpu-threads 16 --host-memory-gib 24)
timeout 120 "$bin/fluxion" bench decode "${common[@]}" \
  --policy fixed_32_0.05,fixed_32_0.02,lfps,fluxion \
  --profile conservative,bench/profiles/tiny-retrieval-16k.json \
  --json "$out/hybrid-8b-32k.json" 2>&1 | tee "$out/hybrid-8b-32k.log"
timeout 100 "$bin/fluxion-base" bench decode "${common[@]}" --policy lfps,fluxion \
  --profile conservative --json "$out/hybrid-8b-32k-base.json" 2>&1 | tee "$out/hybrid-8b-32k-base.log"
args=(--model models/fluxion-tiny-retrieval --contexts 1024,4096 --samples 6
      --policy full,quest,fixed_32_0.05,lfps,fluxion --budget 0.05 --cpu-threads 8)
start=$(date +%s)
for device in cpu cuda; do
  timeout 200 "$bin/fluxion" eval tasks "${args[@]}" --device "$device" \
    --json "$out/eval_$device.json" > "$out/eval_$device.txt" 2>&1 &
done
wait
echo "both eval runs: $(( $(date +%s) - start )) s" | tee "$out/eval_compare.txt"
"$bin/fluxion" eval compare "$out/eval_cpu.json" "$out/eval_cuda.json" \
  --json "$out/eval_compare.json" 2>&1 | tee -a "$out/eval_compare.txt"
