#!/usr/bin/env bash
# Session 20, device call 2 (the binaries of call 1: `fluxion` = d79a6dd, zero-copy reads on a
# lowest-priority stream; `fluxion_s19` = f34685c):
#   1. an Nsight Systems GPU trace of the ping-pong executor at 4 x 128K, fixed_32_0.05 (3 timed
#      steps), kernels of graphs traced one by one, exported as CSV (cuda_gpu_trace): which
#      stream runs when, and where each half's critical path waits;
#   2. the points where ping-pong pays or nearly does (call 1: 16 x 32K), 8 x 64K besides, both
#      binaries, one pipeline and ping-pong, fixed_32_0.02 / 0.05.
source "$(dirname "$0")/prologue.sh"
nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${nsys:-none}" | tee "$out/nsys.txt"
if [[ -n "$nsys" ]]; then
  timeout 240 "$nsys" profile --trace=cuda --cuda-graph-trace=node --sample=none --cpuctxsw=none \
    --force-overwrite true -o /tmp/pp "$bin/fluxion" bench decode --device cuda \
    --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16 --policy fixed_32_0.05 \
    --micro-batches 2 --steps 3 --contexts 131072 --batch 4 --host-memory-gib 84 \
    > "$out/s20-nsys-run.log" 2>&1
  timeout 120 "$nsys" stats --report cuda_gpu_trace --format csv --output /tmp/pp_stats \
    /tmp/pp.nsys-rep > "$out/s20-nsys-stats.log" 2>&1
  ls -la /tmp/pp* >> "$out/nsys.txt" 2>&1
  # The timed part only: the last 40% of the trace's rows hold the policy row's steps.
  f=$(ls /tmp/pp_stats*cuda_gpu_trace*.csv 2>/dev/null | head -1)
  [[ -n "$f" ]] && xz -T4 -c "$f" > "$out/s20-nsys-pp-4x128k-gputrace.csv.xz"
fi
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16
        --policy fixed_32_0.05,fixed_32_0.02 --micro-batches 1,2 --steps 6 --host-memory-gib 84)
run() {  # name binary args...
  local name=$1 exe=$2; shift 2
  timeout 150 "$bin/$exe" bench decode "${common[@]}" "$@" --json "$out/s20-$name.json" 2>&1 |
    tee "$out/s20-$name.log"
}
run 8b-32k-b16-new fluxion --contexts 32768 --batch 16
run 8b-32k-b16-s19 fluxion_s19 --contexts 32768 --batch 16
run 8b-64k-b8-new fluxion --contexts 65536 --batch 8
run 8b-64k-b8-s19 fluxion_s19 --contexts 65536 --batch 8
tar -C "$out" -cJf /tmp/session20-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session20-call2.tar.xz "$out/"
