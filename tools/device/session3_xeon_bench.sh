#!/usr/bin/env bash
# Xeon attention bench of the session-3 LFPS/Fluxion at 128K and 4K on one core (the issue-5
# speed targets' setting). Written in session 3 but not run there: the device refused to start
# with the ~200 s of device time that session had left. Run it first in the next session.
# Bundle: ../shared/device/bundle.sh .device build/fluxion; tar -cJf .device.tar.xz .device;
# carry [".device.tar.xz"]. Output is written line by line under $OUT, so a run cut short by the
# device budget still returns what it measured.
set -uo pipefail
[ -d .device ] || tar -xJf .device.tar.xz
source .device/env.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
lscpu | head -20 > "$out/lscpu.txt"
timeout 150 stdbuf -oL fluxion bench attention --contexts 131072,4096 --threads 1 --repeats 10 \
  --policy full,exact_topk,lfps,lfps_paper,fluxion --budget 0.02,0.05 \
  --json "$out/attention-xeon-session3.json" > "$out/attention-xeon-session3.txt" 2>&1
tail -25 "$out/attention-xeon-session3.txt"
