#!/usr/bin/env bash
# Session 17, device call 2: where an LFPS head-step's time goes on the H200 host's Xeon (the
# devbox's Zen 4 core runs one in ~3 ms, the device's 16 threads take ~5 ms a layer for 8 of
# them). `perf record` (flat, no call graphs: the binary has symbols, no frame pointers) over
# `bench decode --device cuda` at 1 x 128K, lfps under the measured profile, 30 timed steps, then
# `perf report` there. Bundle: fluxion (symbols kept, debug info stripped) and perf.
source "$(dirname "$0")/prologue.sh"
cat /proc/sys/kernel/perf_event_paranoid > "$out/paranoid.txt" 2>&1
lscpu > "$out/lscpu.txt" 2>&1
timeout 240 "$bin/perf" record -F 499 -o /tmp/perf.data -- "$bin/fluxion" bench decode \
  --device cuda --preset llama3.1-8b --budget 0.05 --device-read-share 0.5 --steps 30 \
  --cpu-threads 16 --policy lfps --profile bench/profiles/tiny-retrieval-16k.json \
  --contexts 131072 --batch 1 --host-memory-gib 40 --json "$out/perf-run.json" \
  > "$out/perf-run.log" 2>&1
timeout 120 "$bin/perf" report -i /tmp/perf.data --no-children --sort dso,symbol --stdio \
  2> "$out/perf-report.err" | head -120 > "$out/perf-report.txt"
timeout 60 "$bin/perf" report -i /tmp/perf.data --no-children --sort comm,dso --stdio \
  2>/dev/null | head -40 > "$out/perf-report-threads.txt"
tar -C "$out" -cJf /tmp/session17-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session17-call2.tar.xz "$out/"
