#!/usr/bin/env bash
# Session 13, device call 3 (issue 15): the 128K point (130,048 tokens: a prompt must leave room
# in the 131,072-token context), the GPU prefill's chunk size at 32K, and ucx_perftest over TCP
# with 64 KiB messages (its 128 MiB puts stall over tcp/lo: docs/TRANSFER.md) and shared memory.
source "$(dirname "$0")/prologue.sh"
{
  echo "# $(date -u +%FT%TZ)"
  timeout 300 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b \
    --contexts 8192,130048 --send layerwise,after --ucx-tls tcp --ucx-net-devices lo \
    --json "$out/prefill-8b-tcp-128k.json"
  echo "rc $?"
  for chunk in 4096 8192; do
    timeout 120 "$bin/fluxion" bench prefill --device cuda --preset llama3.1-8b --contexts 32768 \
      --send layerwise --chunk-tokens $chunk --ucx-tls tcp --ucx-net-devices lo \
      --json "$out/prefill-8b-tcp-chunk$chunk.json"
    echo "rc $?"
  done
} 2>&1 | grep -v "Endpoint timeout\|InitGoogleLogging" | tee "$out/bench.log"
{
  for spec in "tcp 65536 4000" "sm 134217728 16"; do
    set -- $spec
    if [ "$1" = sm ]; then env="UCX_TLS=sm,self"; else env="UCX_TLS=tcp UCX_NET_DEVICES=lo"; fi
    echo "## ucx_perftest -t ucp_put_bw -s $2 -n $3 -w 2 with $env"
    port=$((20000 + RANDOM % 10000))
    env $env timeout 60 "$bin/ucx_perftest" -p $port >/dev/null 2>&1 &
    server=$!
    sleep 1
    env $env timeout 50 "$bin/ucx_perftest" 127.0.0.1 -p $port -t ucp_put_bw -s $2 -n $3 -w 2 2>&1 | tail -3
    wait $server 2>/dev/null
  done
} 2>&1 | tee "$out/perftest.log"
tar -C "$out" -cJf /tmp/session13-call3.tar.xz . && rm -rf "$out"/* && mv /tmp/session13-call3.tar.xz "$out/"
