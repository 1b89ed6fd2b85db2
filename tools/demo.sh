#!/usr/bin/env bash
# The README's first command: set up, build, and run the main job.
# Until the local cluster lands (issue 7), the main job is the engine on its own:
#   1. a small random model made on the spot generates tokens (the CPU runtime end to end);
#   2. the trained retrieval model (models/fluxion-tiny-retrieval) answers long-context questions
#      with full attention and with LFPS reading 5% of the KV, printed next to the
#      expected answers.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLUXION_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target fluxion
./build/fluxion make-model --preset tiny --out build/models/tiny
./build/fluxion generate --model build/models/tiny --prompt-ids 1,17,42,99,7,256,3 \
  --max-tokens 32 --ignore-eos
./build/fluxion eval tasks --model models/fluxion-tiny-retrieval \
  --tasks niah_single,niah_multikey,niah_multivalue --contexts 4096 --samples 2 \
  --policy full,lfps --budget 0.05 --show
