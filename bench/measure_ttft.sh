#!/usr/bin/env bash
# TTFT split of the served pair with the trained model: prefill compute, KV transfer (total and
# the tail not hidden behind compute), decode-side admission and load, with layer-wise sending
# against sending after the last layer, over UCX TCP on lo and shared memory.
# Also the cancellation release time (p50/p99) for a client cancelling during prefill and during
# decode (CANCEL_PROMPT tokens, cancelled CANCEL_AFTER_MS after sending).
# Usage: bench/measure_ttft.sh BUILD_DIR OUT_FILE "PROMPT_LENGTHS" [REQUESTS]
set -uo pipefail
build=${1:?build dir}; out=${2:?output file}; lengths=${3:-"1024 4096"}; requests=${4:-5}; policies=${POLICIES:-"fluxion full"}
cancel_prompt=${CANCEL_PROMPT:-2048}; cancel_after=${CANCEL_AFTER_MS:-"30 1500"}
model=models/fluxion-tiny-retrieval
dir=$(mktemp -d)
start() {  # name args...
  local name=$1; shift
  "$build/fluxion" "$@" --listen 127.0.0.1:0 --port-file "$dir/$name.port" >"$dir/$name.log" 2>&1 &
  echo $! > "$dir/$name.pid"
  for _ in $(seq 500); do [ -s "$dir/$name.port" ] && return 0; sleep 0.02; done
  echo "$name did not start"; cat "$dir/$name.log"; return 1
}
stop() { kill "$(cat "$dir/$1.pid")" 2>/dev/null; wait "$(cat "$dir/$1.pid")" 2>/dev/null; rm -f "$dir/$1.port"; }
{
  echo "# date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD)  host: $(uname -n)"
  echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)  cores: $(nproc)  load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# model: $model, max_tokens 1; policy fluxion: the sparse state is captured and travels too;"
  echo "# policy full: KV only. state_ms = sparse-state capture on the prefill node (after compute)"
  echo "# $requests requests per row after one warm-up, medians in ms; prefill and decode with --cpu-threads 1 each"
  printf "%-28s %7s %9s %11s %9s %11s %10s %9s %10s %9s %8s\n" "config" "prompt" "admit_ms" \
    "compute_ms" "state_ms" "transfer_ms" "tail_ms" "load_ms" "prefill_ms" "ttft_ms" "tail/ttft"
  for tls in tcp sm; do
    if [ "$tls" = sm ]; then ucx="--ucx-tls sm,self --noucx-peer-error-handling"; else ucx="--ucx-tls tcp --ucx-net-devices lo"; fi
    for layerwise in --layerwise --nolayerwise; do
      start prefill prefill --model $model --cpu-threads 1 $layerwise $ucx || exit 1
      start decode decode --model $model --cpu-threads 1 --kv-pages 65536 --nohuge-pages \
        --prefill-address 127.0.0.1:$(cat "$dir/prefill.port") $ucx || exit 1
      for policy in $policies; do
        for n in $lengths; do
          "$build/fluxion" bench serving-ttft --decode 127.0.0.1:$(cat "$dir/decode.port") \
            --prompt_tokens $n --requests $requests --policy $policy \
            --label "$tls ${layerwise#--} $policy"
        done
      done
      if [ "$tls$layerwise" = "tcp--layerwise" ]; then
        echo "# cancellation: client cancels, time until every KV page is free again (GetLoad)"
        for after in $cancel_after; do
          "$build/fluxion" bench serving-ttft --decode 127.0.0.1:$(cat "$dir/decode.port") \
            --prompt_tokens $cancel_prompt --requests 30 --cancel_after_ms $after --verbose \
            --label "$tls ${layerwise#--}"
        done
      fi
      stop decode; stop prefill
    done
  done
} > "$out" 2>&1
rm -rf "$dir"
