#!/usr/bin/env bash
# The README's first command: set up, build, and run the main job.
#   1. `fluxion local`: a router, a prefill node and a decode node as separate processes on this
#      machine (real gRPC, KV over real UCX into the decode node's host pages), serving the bundled
#      Mooncake trace scaled to the machine with the trained model; prints the replay report
#      (TTFT, TPOT, ITL, E2E, throughput, goodput, errors) and where the plots are, then shuts
#      everything down.
#   2. The trained retrieval model answers long-context questions with full attention and with
#      LFPS and Fluxion reading 5% of the KV, printed next to the expected answers.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLUXION_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target fluxion
./build/fluxion local --out-dir build/local-report
./build/fluxion eval tasks --model models/fluxion-tiny-retrieval \
  --tasks niah_multikey,aggregate --contexts 4096 --samples 2 \
  --policy full,lfps,fluxion --budget 0.05 --show
