#!/usr/bin/env bash
# The issue-6 transfer measurement: the KV of a 32K-token Llama-3.1-8B prompt (32 layers x 8 KV
# heads x 2048 pages of 16 tokens x head_dim 128 bf16 = 8 KiB pages, 4 GiB) written between two
# processes the way the prefill node sends it (one Write per layer, all in flight, then waited),
# next to ucx_perftest's put bandwidth with the same message size (one layer, 128 MiB) and a
# plain memcpy, under UCX_TLS=sm and tcp on loopback; logs which transport UCX picked.
# Usage: transfer/measure_kv_transfer.sh BUILD_DIR OUT_FILE [ITERS]
set -uo pipefail
build=${1:?build dir}; out=${2:?output file}; iters=${3:-3}
bench=$build/transfer/transfer_bench
{
  echo "# date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD)  host: $(uname -n)"
  echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)  cores: $(nproc)  mem: $(free -g | awk '/Mem/{print $2}') GiB"
  echo "# ucx: $(ucx_info -v | head -1)  load: $(cut -d' ' -f1-3 /proc/loadavg)"
  for tls in sm tcp; do
    for alloc in --noallocate --allocate; do
      echo; echo "## transfer_bench --tls=$tls $alloc --mib 4096 --page_kib 8 --batches 32 --iters $iters"
      "$bench" --tls=$tls $alloc --mib 4096 --page_kib 8 --batches 32 --noall_modes --iters "$iters" 2>&1
    done
  done
  for tls in sm tcp; do
    if [ "$tls" = sm ]; then env="UCX_TLS=sm,self"; else env="UCX_TLS=tcp UCX_NET_DEVICES=lo"; fi
    echo; echo "## ucx_perftest -t ucp_put_bw -s 134217728 -n 32 -w 2 with $env (server and client)"
    port=$((20000 + RANDOM % 10000))
    env $env ucx_perftest -p $port >/dev/null 2>&1 &
    server=$!
    sleep 1
    env $env UCX_PROTO_ENABLE=y UCX_PROTO_INFO=y ucx_perftest 127.0.0.1 -p $port -t ucp_put_bw \
      -s 134217728 -n 32 -w 2 2>&1 | grep -v '^$' | head -60
    wait $server 2>/dev/null
  done
  echo; echo "## UCX_PROTO_INFO for transfer_bench (what UCX picks for our puts), UCX_PROTO_ENABLE=y"
  for tls in sm tcp; do
    echo "### --tls=$tls"
    UCX_PROTO_ENABLE=y UCX_PROTO_INFO=y "$bench" --tls=$tls --mib 64 --noall_modes --iters 1 \
      --noshow_endpoint 2>&1 | grep -E '^\[|\|' | head -30
  done
} > "$out" 2>&1
