#!/usr/bin/env bash
# Session 19, device call 2 (binaries: fluxion = 72fe075, symbols kept and debug info stripped;
# fluxion_s17 = 06eafe5):
#   1. where an LFPS step's time goes on the H200 host now that the observation runs beside the
#      next layer's selections and the rescoring builds its spans in tasks: `perf record -F 999`
#      (flat: no frame pointers) over 30 steps of lfps@0.05 conservative at 1 x 128K, reports by
#      symbol and by thread there;
#   2. 4 x 128K at budget 0.05, conservative and measured profiles, this session's binary then
#      session 17's (the batch-4 effect of sessions 18-19's changes).
source "$(dirname "$0")/prologue.sh"
cat /proc/sys/kernel/perf_event_paranoid > "$out/paranoid.txt" 2>&1
timeout 200 "$bin/perf" record -F 999 -o /tmp/perf.data -- "$bin/fluxion" bench decode \
  --device cuda --preset llama3.1-8b --budget 0.05 --device-read-share 0.5 --steps 30 \
  --cpu-threads 16 --policy lfps --profile conservative \
  --contexts 131072 --batch 1 --host-memory-gib 40 --json "$out/s19-perf-run.json" \
  > "$out/s19-perf-run.log" 2>&1
timeout 120 "$bin/perf" report -i /tmp/perf.data --no-children --sort dso,symbol --stdio \
  2> "$out/perf-report.err" | head -150 > "$out/s19-perf-report.txt"
timeout 60 "$bin/perf" report -i /tmp/perf.data --no-children --sort dso --stdio \
  2>/dev/null | head -40 > "$out/s19-perf-report-dso.txt"
common=(--device cuda --preset llama3.1-8b --device-read-share 0.5 --cpu-threads 16 --budget 0.05
        --profile conservative,bench/profiles/tiny-retrieval-16k.json --contexts 131072
        --batch 4 --steps 4 --host-memory-gib 84 --policy fixed_32_0.05,lfps,fluxion)
run() {  # name binary
  timeout 170 "$bin/$2" bench decode "${common[@]}" --json "$out/s19-$1.json" 2>&1 |
    tee "$out/s19-$1.log"
}
run 8b-128k-b4-new fluxion
run 8b-128k-b4-s17 fluxion_s17
tar -C "$out" -cJf /tmp/session19-call2.tar.xz . && rm -rf "$out"/* && mv /tmp/session19-call2.tar.xz "$out/"
