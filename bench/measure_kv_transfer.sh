#!/usr/bin/env bash
# The KV transfer measurement: the KV of a 32K-token Llama-3.1-8B prompt (32 layers x 8 KV heads x
# 2048 pages of 16 tokens x head_dim 128 bf16 = 8 KiB pages, 4 GiB) written between two processes
# the way the prefill node sends it (one Write per layer, all in flight, then waited), next to
# ucx_perftest's put bandwidth with the same message size (one layer, 128 MiB) and a plain memcpy,
# under UCX_TLS=sm and tcp on loopback; logs which lanes and thresholds UCX picked.
# Usage: bench/measure_kv_transfer.sh BUILD_DIR OUT_FILE [ITERS]
#   BASELINE_BENCH="path/to/another/fluxion bench transfer": also run that build, interleaved with
#   this one (same arguments), to compare two versions on this noisy machine in one file.
set -uo pipefail
build=${1:?build dir}; out=${2:?output file}; iters=${3:-3}
bench=("$build/fluxion" bench transfer)
read -ra baseline <<< "${BASELINE_BENCH:-}"
args=(--mib 4096 --page_kib 8 --batches 32 --noall_modes --iters "$iters")
{
  echo "# date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD)  host: $(uname -n)"
  echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)  cores: $(nproc)  mem: $(free -g | awk '/Mem/{print $2}') GiB"
  echo "# ucx: $(ucx_info -v | head -1)  load: $(cut -d' ' -f1-3 /proc/loadavg)"
  for tls in sm tcp; do
    if [ ${#baseline[@]} -gt 0 ]; then
      echo; echo "## baseline (${baseline[*]}) --tls=$tls ${args[*]}  load: $(cut -d' ' -f1-3 /proc/loadavg)"
      "${baseline[@]}" --tls=$tls "${args[@]}" 2>&1
    fi
    echo; echo "## fluxion bench transfer --tls=$tls ${args[*]}  load: $(cut -d' ' -f1-3 /proc/loadavg)"
    "${bench[@]}" --tls=$tls "${args[@]}" 2>&1
  done
  for tls in sm tcp; do
    if [ "$tls" = sm ]; then env="UCX_TLS=sm,self"; else env="UCX_TLS=tcp UCX_NET_DEVICES=lo"; fi
    echo; echo "## ucx_perftest -t ucp_put_bw -s 134217728 -n 32 -w 2 with $env (server and client)"
    port=$((20000 + RANDOM % 10000))
    env $env timeout 300 ucx_perftest -p $port >/dev/null 2>&1 &
    server=$!
    sleep 1
    env $env UCX_PROTO_ENABLE=y UCX_PROTO_INFO=y timeout 240 ucx_perftest 127.0.0.1 -p $port \
      -t ucp_put_bw -s 134217728 -n 32 -w 2 2>&1 | grep -v '^$' | head -60
    kill $server 2>/dev/null; wait $server 2>/dev/null
  done
  # What UCX picks for our messages: the endpoint's lanes and thresholds (the bench prints
  # ucp_ep_print_info at the start of each run above). Not UCX_PROTO_INFO: it needs
  # UCX_PROTO_ENABLE=y, which the transport refuses on UCX 1.13 (docs/TRANSFER.md).
} > "$out" 2>&1
