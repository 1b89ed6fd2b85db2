#!/usr/bin/env bash
# The README's first command: set up, build, and run the main job.
# Until the local cluster lands (issue 7), the main job makes a small random model and generates
# tokens from it with the CPU runtime.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLUXION_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target fluxion
./build/fluxion make-model --preset tiny --out build/models/tiny
./build/fluxion generate --model build/models/tiny --prompt-ids 1,17,42,99,7,256,3 \
  --max-tokens 32 --ignore-eos
