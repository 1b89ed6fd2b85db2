#!/bin/sh
# Renders every kustomization, checks what must be in it, and validates every object offline
# against the Kubernetes API schemas and the deployment rules (k8s/validate/validate.mjs, npm
# kubernetes-models). Usage: k8s/check.sh [WORK_DIR] (where npm installs the validator; default a
# temporary directory). Needs `kubectl` (its built-in kustomize >= 5: Debian 12's kubernetes-client
# 1.20 is too old for `labels` and components) and Node.js with npm; without them it exits 77, which
# ctest reports as skipped.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=${1:-$(mktemp -d)}
for tool in kubectl node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "$tool not installed: skipping the kustomize check"
    exit 77
  fi
done
mkdir -p "$work"
# npm ci once per lock file (a rerun in the same build tree skips it); --prefer-offline: the npm
# cache answers when it has the packages (reruns, cached CI runners).
if ! cmp -s "$here/validate/package-lock.json" "$work/package-lock.json" ||
   [ ! -d "$work/node_modules/kubernetes-models" ]; then
  cp "$here/validate/package.json" "$here/validate/package-lock.json" "$work/"
  (cd "$work" && npm ci --prefer-offline --no-audit --no-fund --loglevel=error >/dev/null)
fi
cp "$here/validate/validate.mjs" "$work/"
cd "$here"
# overlay:objects
for entry in base:14 overlays/dev:15 overlays/gpu:14 overlays/gpu-monitored:16 overlays/llm-d:16; do
  dir=${entry%%:*}
  want_objects=${entry##*:}
  out=$(kubectl kustomize "$dir")
  for want in "kind: Deployment" "kind: StatefulSet" "kind: PodDisruptionBudget" \
              "kind: NetworkPolicy" "clusterIP: None" "prometheus.io/scrape" \
              "--decode-dns=fluxion-decode:7002" "--prefill-dns=fluxion-prefill:7001" "grpc:" \
              "service: fluxion.v1.DecodeService" "--drain-timeout-ms=30000" \
              "readOnlyRootFilesystem: true" "runAsNonRoot: true" "UCX_TCP_PORT_RANGE" \
              "--metrics-listen=0.0.0.0:9100" "llm-d.ai/engine-type: fluxion$" \
              "llm-d.ai/engine-type: fluxion-prefill" \
              "llm-d.ai/role: decode" "llm-d.ai/role: prefill" \
              "--transfer-secret-file=/etc/fluxion/transfer/secret" "secretName: fluxion-transfer" \
              "--tls-require-client-cert" "--prefill-tls-ca=/etc/fluxion/tls/ca.crt" \
              "--backend-tls-server-name=fluxion-nodes" "secretName: fluxion-tls"; do
    printf '%s' "$out" | grep -q -- "$want" || { echo "$dir: missing '$want'"; exit 1; }
  done
  n=$(printf '%s\n' "$out" | grep -c '^kind:')
  [ "$n" -eq "$want_objects" ] || { echo "$dir: $n objects, want $want_objects"; exit 1; }
  printf '%s\n' "$out" | node "$work/validate.mjs" "$dir" | tail -n 1
done
# The GPU overlays: RDMA resources, huge pages, IPC_LOCK, mutual TLS.
out=$(kubectl kustomize overlays/gpu)
for want in "rdma/rdma_shared_device_a: 1" "hugepages-2Mi: 64Gi" "- IPC_LOCK" "--ucx-tls=rc,tcp" \
            "--tls-require-client-cert" "--backend-tls-server-name=fluxion-nodes" \
            "--prefill-tls-ca=/etc/fluxion/tls/ca.crt" "secretName: fluxion-tls" "path: /readyz"; do
  printf '%s' "$out" | grep -q -- "$want" || { echo "overlays/gpu: missing '$want'"; exit 1; }
done
kubectl kustomize overlays/gpu-monitored | grep -q "kind: ServiceMonitor" ||
  { echo "overlays/gpu-monitored: no ServiceMonitor"; exit 1; }
# Behind llm-d: every decode pod has a router sidecar serving OpenAI HTTP for its own decode node.
out=$(kubectl kustomize overlays/llm-d)
for want in "--decode=127.0.0.1:7002" "--http-listen=0.0.0.0:8000" "name: fluxion-decode-llm-d" \
            "--backend-tls-cert=/etc/fluxion/tls/tls.crt"; do
  printf '%s' "$out" | grep -q -- "$want" || { echo "overlays/llm-d: missing '$want'"; exit 1; }
done
# Every container of every overlay runs a tagged image: an image a patch or component adds after
# the base's `images:` ran stays bare (`fluxion`, i.e. :latest from whatever registry answers).
for dir in base overlays/dev overlays/gpu overlays/gpu-monitored overlays/llm-d; do
  bare=$(kubectl kustomize "$dir" | grep -E '^ *image: [^:@]+$' || true)
  [ -z "$bare" ] || { echo "$dir: untagged image: $bare"; exit 1; }
done
# The llm-d EPP configs (not kustomize resources) scrape /metrics where the pods serve it: 9100
# on decode and prefill pods, not the InferencePool's target port (8000, the OpenAI API).
for f in llm-d/epp-config.yaml llm-d/epp-config-pd.yaml; do
  awk '/type: metrics-data-source/{s=1} s&&/port: 9100/{found=1} END{exit !found}' "$f" ||
    { echo "$f: the metrics-data-source does not name port 9100"; exit 1; }
done
echo "k8s: every overlay renders and validates"
