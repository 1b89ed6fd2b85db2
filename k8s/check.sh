#!/bin/sh
# Builds every kustomization and checks the objects come out. Needs `kubectl` (its built-in
# kustomize); Debian 12 does not package it, so without it this exits 77, which ctest reports as
# skipped.
set -eu
cd "$(dirname "$0")"
if ! command -v kubectl >/dev/null 2>&1; then
  echo "kubectl not installed: skipping the kustomize check"
  exit 77
fi
for dir in base overlays/dev overlays/gpu; do
  out=$(kubectl kustomize "$dir")
  for want in "kind: Deployment" "kind: StatefulSet" "clusterIP: None" "prometheus.io/scrape" \
              "--decode-dns=fluxion-decode:7002" "--prefill-dns=fluxion-prefill:7001" "grpc:" \
              "service: fluxion.v1.DecodeService" "service: fluxion.v1.PrefillService" \
              "--metrics-listen=0.0.0.0:9100" "llm-d.ai/engine-type: fluxion$" \
              "llm-d.ai/engine-type: fluxion-prefill" \
              "llm-d.ai/role: decode" "llm-d.ai/role: prefill"; do
    printf '%s' "$out" | grep -q -- "$want" || { echo "$dir: missing '$want'"; exit 1; }
  done
  n=$(printf '%s\n' "$out" | grep -c '^kind:')
  [ "$n" -eq 6 ] || { echo "$dir: $n objects, want 6"; exit 1; }
  echo "$dir: ok ($n objects)"
done
