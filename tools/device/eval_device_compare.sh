#!/usr/bin/env bash
# Issue 14, "quality must not move": `fluxion eval tasks` through the CUDA hybrid executor against
# the CPU path on the same seeds, then `fluxion eval compare` (docs/TASKS.md, "Decode path").
#   eval_device_compare.sh [SAMPLES] [CONTEXTS] [THREADS]     defaults: 10 1024,4096 8
# First the CUDA smoke test (eval_cuda_test), then both runs at once (each on THREADS cores; the
# outcomes do not depend on what else runs), then the comparison. Files in $OUT (7): the test log,
# eval_{cpu,cuda}.{json,txt}, eval_compare.{json,txt}.
# Bundle: ../shared/device/bundle.sh .device build/fluxion build/tests/eval_cuda_test;
# tar -cJf .device.tar.xz .device; carry [".device.tar.xz"].
set -uo pipefail
samples=${1:-10}
contexts=${2:-1024,4096}
threads=${3:-8}
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
export OPENBLAS_CORETYPE=SKYLAKEX FLUXION_SOURCE_DIR=$PWD
if [[ -x $bin/eval_cuda_test ]]; then
  timeout 120 "$bin/eval_cuda_test" 2>&1 | tail -20 | tee "$out/eval_cuda_test.log"
fi
args=(--model models/fluxion-tiny-retrieval --contexts "$contexts" --samples "$samples"
      --policy full,quest,fixed_32_0.05,lfps,fluxion --budget 0.05 --cpu-threads "$threads")
start=$(date +%s)
for device in cpu cuda; do
  timeout 480 "$bin/fluxion" eval tasks "${args[@]}" --device "$device" \
    --json "$out/eval_$device.json" > "$out/eval_$device.txt" 2>&1 &
done
wait
echo "both runs: $(( $(date +%s) - start )) s"
for f in "$out"/eval_cpu.txt "$out"/eval_cuda.txt; do echo "== $f"; tail -n 3 "$f"; done
"$bin/fluxion" eval compare "$out/eval_cpu.json" "$out/eval_cuda.json" \
  --json "$out/eval_compare.json" 2>&1 | tee "$out/eval_compare.txt"
