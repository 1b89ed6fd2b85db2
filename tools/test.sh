#!/usr/bin/env bash
# The README's second command: set up, build everything, run the test suite.
# GPU tests (ctest label "cuda") skip cleanly on machines without a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLUXION_BUILD_TESTS=ON >/dev/null
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 600
