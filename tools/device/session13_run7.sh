#!/usr/bin/env bash
# Session 13, device call 7 (issue 15): the served path with the GPU prefill: `fluxion local` with
# the prefill node on the GPU (--device cuda) and the decode node's hybrid step, the trained model,
# a short replay of the bundled Mooncake trace; the prefill node's log kept.
source "$(dirname "$0")/prologue.sh"
timeout 150 "$bin/fluxion" local --model models/fluxion-tiny-retrieval \
  --trace cluster/traces/mooncake_conversation_30s.jsonl --prefill-device cuda --decode-device cuda \
  --cpu-threads 4 --max-requests 16 2>&1 | tail -40 | tee "$out/local.log"
cp /tmp/fluxion-local-*/logs/prefill-0.log "$out/" 2>/dev/null
tar -C "$out" -cJf /tmp/session13-call7.tar.xz . && rm -rf "$out"/* && mv /tmp/session13-call7.tar.xz "$out/"
