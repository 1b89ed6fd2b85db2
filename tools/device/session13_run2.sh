#!/usr/bin/env bash
# Session 13, device call 2 (issue 15): the device tests after the FlashAttention-2-style kernel
# (mma.sync, cp.async) replaced the WMMA one and the staging became pinned; then the TTFT table at
# 8K-128K over UCX TCP (layer-wise vs after the last layer), 32K over shared memory, torch's
# prefill at the same lengths, and ucx_perftest's put bandwidth on both transports.
source "$(dirname "$0")/prologue.sh"
{
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  timeout 120 "$bin/kernels_cuda_prefill_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure|Expected|Which|worst|actual' | head -60
  timeout 240 "$bin/prefill_device_test" 2>&1 | grep -E '^\[ +(FAILED|PASSED|OK) |^\[==========\]|Failure|Expected|Which|worst|actual|error' | head -60
} 2>&1 | tee "$out/tests.log"
{
  timeout 420 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 8192,32768,65536,131072 --send layerwise,after --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/prefill-8b-tcp.json"
  echo "rc $?"
  timeout 200 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b --contexts 32768 \
    --send layerwise,after --ucx-tls sm,self --noucx-peer-error-handling \
    --json "$out/prefill-8b-sm.json"
  echo "rc $?"
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/bench.log"
timeout 300 python3 bench/anchor_prefill.py --contexts 8192,32768,65536,131072 --chunk 2048 \
  --json "$out/anchor-prefill.json" 2>&1 | tail -8 | tee "$out/anchor.log"
{
  for tls in tcp sm; do
    if [ "$tls" = sm ]; then env="UCX_TLS=sm,self"; else env="UCX_TLS=tcp UCX_NET_DEVICES=lo"; fi
    echo "## ucx_perftest -t ucp_put_bw -s 134217728 -n 16 -w 2 with $env"
    port=$((20000 + RANDOM % 10000))
    env $env timeout 60 "$bin/ucx_perftest" -p $port >/dev/null 2>&1 &
    server=$!
    sleep 1
    env $env timeout 60 "$bin/ucx_perftest" 127.0.0.1 -p $port -t ucp_put_bw -s 134217728 -n 16 -w 2 2>&1 | tail -4
    wait $server 2>/dev/null
  done
} 2>&1 | tee "$out/perftest.log"
tar -C "$out" -cJf /tmp/session13-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session13-call2.tar.xz "$out/"
