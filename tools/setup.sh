#!/usr/bin/env bash
# Installs exactly the Debian 12 packages Fluxion needs to build, test and run. Idempotent: a
# second run installs nothing. Why each package is here: docs/DEPENDENCIES.md.
set -euo pipefail

packages=(
  build-essential cmake pkg-config            # toolchain (CMake >= 3.25 in Debian 12)
  libgrpc++-dev protobuf-compiler-grpc        # gRPC services and the grpc_cpp_plugin
  libprotobuf-dev protobuf-compiler           # wire contract (proto/)
  libucx-dev ucx-utils                        # KV transfer (transfer/ucx), ucx_info for diagnostics
  libabsl-dev                                 # Status/StatusOr, flags, Mutex, Span
  libgoogle-glog-dev                          # logging
  libgtest-dev libgmock-dev                   # tests
  libopenblas-openmp-dev                      # CPU GEMM/GEMV, OpenMP build so it shares our thread pool
  nlohmann-json3-dev                          # config.json, safetensors headers, --json output
  libmicrohttpd-dev                           # HTTP /metrics endpoints (common/metrics_http)
  libpcre2-dev                                # HF tokenizer.json pre-tokenizer regexes (lookahead)
  libicu-dev                                  # NFC normalization of HF tokenizers (Qwen2)
  libcurl4-openssl-dev                        # HTTP client: fluxion local's chat answer, API tests
  libssl-dev                                  # libcrypto: HMAC-SHA256 seals on prefill requests
  prometheus                                  # promtool: tests lint every /metrics endpoint
  gnuplot-nox                                 # fluxion replay: latency CDF and throughput plots
  python3                                     # tools/eval: result tables (and their ctest)
  python3-numpy                               # tools/eval/compact_bits.py: captured steps (.npy)
  openssl                                     # TLS tests: throwaway CA and certificates at run time
  clang libclang-rt-14-dev                    # libFuzzer targets and their sanitizers (tools/fuzz.sh)
  ninja-build                                 # the fuzz and sanitizer build dirs of tools/test.sh
  nodejs                                      # tests/js: the openai npm SDK against the HTTP API
  iproute2 nftables                           # fault suite: network namespaces, veth, tc; packet loss
  iptables libnetfilter-queue-dev             # fault suite: added delay (NFQUEUE + tests/link_delay)
  buildah mmdebstrap crun fuse-overlayfs      # the container image, built daemonless from Debian's
                                              #   mirror (tools/build_image.sh; CI builds it)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm (tests/js's `npm ci`): Debian's package, unless a Node.js that bundles npm (NodeSource's
# nodejs, which conflicts with Debian's npm) already provides it.
command -v npm > /dev/null || missing+=(npm)
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages already installed"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
