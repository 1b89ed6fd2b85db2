#!/usr/bin/env bash
# The soak (issue 17, docs/FAULTS.md "Soak"): the local cluster -- a router, PREFILL_NODES prefill
# and DECODE_NODES decode processes on loopback, real gRPC, KV over real UCX (TCP on lo) -- under
# `fluxion replay` at about its saturation rate for DURATION_S seconds, with every process's RSS
# and thread count and the router's page counters sampled (replay --sample-interval-s).
#
#   tools/soak.sh [OUT_DIR]          # defaults: 600 s, 1 prefill + 1 decode node
#   DURATION_S=14400 tools/soak.sh   # the hours-long run by hand
#
# 1. Saturation: a closed loop at SAT_CONCURRENCY requests in flight for SAT_REQUESTS requests
#    measures the cluster's throughput (req/s); that is the saturation rate.
# 2. The soak: Poisson arrivals at RATE_FRACTION (0.95) of it for DURATION_S, the same request
#    shape, every request one of DISTINCT_PROMPTS (64) prompts, greedy, so that answers to the
#    same prompt can be compared token for token (replay --distinct-prompts). Exit status 0 when
#    the verdict (OUT_DIR/verdict.txt) passes: errors only from the router's shedding, no sampled
#    process died, RSS and threads flat after the warm-up, the KV pages back to their starting
#    count, and every answer equal to the first answer to its prompt (no corrupted output).
# Writes OUT_DIR/{saturation,soak}/ (summary.json, requests.csv, samples.csv, plots), logs/, and
# memory.csv: every node's malloc bytes in use and held free (its /metrics,
# common/memory_metrics.h) every SAMPLE_S, so that an RSS rise reads as a leak (in use climbs) or
# as the allocator keeping freed memory (held free climbs, in use flat); the report ends with it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FLUXION_BINARY:-build/fluxion}
OUT=${1:-/tmp/fluxion-soak-$(date +%s)}
DURATION_S=${DURATION_S:-600}
PREFILL_NODES=${PREFILL_NODES:-1}
DECODE_NODES=${DECODE_NODES:-1}
INPUT_LEN=${INPUT_LEN:-uniform:64:512}
OUTPUT_LEN=${OUTPUT_LEN:-uniform:8:64}
SAT_CONCURRENCY=${SAT_CONCURRENCY:-16}
SAT_REQUESTS=${SAT_REQUESTS:-120}
RATE_FRACTION=${RATE_FRACTION:-0.95}
SAMPLE_S=${SAMPLE_S:-10}
WARMUP_S=${WARMUP_S:-60}
DISTINCT_PROMPTS=${DISTINCT_PROMPTS:-64}
MODEL=${MODEL:-models/fluxion-tiny-retrieval}
mkdir -p "$OUT/logs"

pids=()
memory_sampler=""
cleanup() {
  # The memory sampler first (a loop that would outlive the script on an early exit), then the
  # nodes in reverse start order: router, decode nodes, prefill nodes; SIGTERM, then wait.
  [[ -z "$memory_sampler" ]] || kill "$memory_sampler" 2>/dev/null || true
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

wait_port() {  # file pid -> prints the port once the file holds one
  for _ in $(seq 1 600); do
    if [[ -s "$1" ]]; then cat "$1"; return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "process $2 exited; see $OUT/logs" >&2; return 1; }
    sleep 0.2
  done
  echo "timed out waiting for $1" >&2
  return 1
}

# The secret the nodes seal and check prefill requests with (docs/SECURITY.md).
(umask 077; openssl rand -hex 32 > "$OUT/logs/transfer.secret")
sample=()
start_node() {  # kind index extra-args...
  local kind=$1 i=$2; shift 2
  local name="$kind-$i"
  "$BIN" "$kind" --model "$MODEL" --listen 127.0.0.1:0 --port-file "$OUT/logs/$name.port" \
    --metrics-listen 127.0.0.1:0 --metrics-port-file "$OUT/logs/$name.metrics-port" \
    --cpu-threads 1 --ucx-tls tcp --ucx-net-devices lo \
    --transfer-secret-file "$OUT/logs/transfer.secret" "$@" > "$OUT/logs/$name.log" 2>&1 &
  pids+=($!)
  sample+=("$name=$!")
}

prefills=()
for ((i = 0; i < PREFILL_NODES; i++)); do start_node prefill "$i"; done
for ((i = 0; i < PREFILL_NODES; i++)); do
  prefills+=("127.0.0.1:$(wait_port "$OUT/logs/prefill-$i.port" "${pids[i]}")")
done
prefill_list=$(IFS=,; echo "${prefills[*]}")
decodes=()
for ((i = 0; i < DECODE_NODES; i++)); do
  start_node decode "$i" --kv-pages 16384 --prefill-address "$prefill_list"
done
for ((i = 0; i < DECODE_NODES; i++)); do
  decodes+=("127.0.0.1:$(wait_port "$OUT/logs/decode-$i.port" "${pids[PREFILL_NODES + i]}")")
done
"$BIN" router --listen 127.0.0.1:0 --port-file "$OUT/logs/router.port" \
  --metrics-listen 127.0.0.1:0 --metrics-port-file "$OUT/logs/router.metrics-port" \
  --decode "$(IFS=,; echo "${decodes[*]}")" --prefill "$prefill_list" > "$OUT/logs/router.log" 2>&1 &
router_pid=$!
pids+=("$router_pid")
sample+=("router=$router_pid")
router="127.0.0.1:$(wait_port "$OUT/logs/router.port" "$router_pid")"
# Until the router's health polls count every decode node healthy (its /metrics), at most 120 s.
router_metrics=$(wait_port "$OUT/logs/router.metrics-port" "$router_pid")
healthy=""
for _ in $(seq 1 600); do
  if curl -s --max-time 2 "http://127.0.0.1:$router_metrics/metrics" |
      grep -qxF "fluxion_router_backends_healthy{role=\"decode\"} $DECODE_NODES"; then
    healthy=1
    break
  fi
  sleep 0.2
done
[[ -n "$healthy" ]] || { echo "the router never saw the $DECODE_NODES decode nodes healthy" >&2; exit 1; }
sample_list=$(IFS=,; echo "${sample[*]}")
echo "soak: router $router, decode ${decodes[*]}, prefill ${prefills[*]}; sampling $sample_list"

common=(--target "$router" --synthetic --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN"
        --vocab-size 256 --timeout-s 120 --noprogress)
echo "== saturation: $SAT_REQUESTS requests at $SAT_CONCURRENCY in flight"
"$BIN" replay "${common[@]}" --num-requests "$SAT_REQUESTS" --concurrency "$SAT_CONCURRENCY" \
  --seed 7 --out-dir "$OUT/saturation" | tee "$OUT/saturation.txt"
sat=$(python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['succeeded']/s['duration_s'])" \
  "$OUT/saturation/summary.json")
rate=$(python3 -c "print(round($sat * $RATE_FRACTION, 3))")
num=$(python3 -c "print(int($rate * $DURATION_S))")
echo "saturation throughput $sat req/s; soak at $rate req/s ($RATE_FRACTION x) for ${DURATION_S} s = $num requests"

# memory.csv: t_s,name,resident,in_use,free_held from each node's /metrics while the soak runs.
sample_memory() {
  local t0=$SECONDS name port
  echo "t_s,name,resident_bytes,malloc_in_use_bytes,malloc_free_held_bytes" > "$OUT/memory.csv"
  while true; do
    for f in "$OUT"/logs/*.metrics-port; do
      name=$(basename "$f" .metrics-port)
      port=$(cat "$f")
      curl -s --max-time 2 "http://127.0.0.1:$port/metrics" | awk -v t=$((SECONDS - t0)) -v n="$name" '
        $1 == "fluxion_process_resident_bytes" {r = $2}
        $1 == "fluxion_malloc_in_use_bytes" {u = $2}
        $1 == "fluxion_malloc_free_held_bytes" {h = $2}
        END {if (u != "") printf "%d,%s,%.0f,%.0f,%.0f\n", t, n, r, u, h}' >> "$OUT/memory.csv"
    done
    sleep "$SAMPLE_S"
  done
}
sample_memory &
memory_sampler=$!

echo "== soak"
set +e
"$BIN" replay "${common[@]}" --num-requests "$num" --rate "$rate" --seed 11 \
  --sample-interval-s "$SAMPLE_S" --sample-warmup-s "$WARMUP_S" --sample-pids "$sample_list" \
  --distinct-prompts "$DISTINCT_PROMPTS" --out-dir "$OUT/soak" | tee "$OUT/soak.txt"
rc=${PIPESTATUS[0]}
set -e
kill "$memory_sampler" 2>/dev/null || true
echo "replay exit status $rc (1 also when requests were shed)"
# The verdict: errors only from shedding (the router's RESOURCE_EXHAUSTED at the KV threshold,
# expected at saturation), no sampled process died, RSS and threads flat after the warm-up, the
# KV pages back to their starting count, every repeated prompt answered with the same tokens.
set +e
python3 - "$OUT/soak/summary.json" <<'PY' | tee "$OUT/verdict.txt"
import json, sys
s = json.load(open(sys.argv[1]))
r = s["resources"]
problems = []
other = {k: v for k, v in s["errors_by_code"].items() if k != "RESOURCE_EXHAUSTED"}
if other:
    problems.append(f"errors other than shedding: {other}")
for p in r["processes"]:
    if p["died"]:
        problems.append(f"{p['name']} died")
    elif not (p["rss_flat"] and p["threads_flat"]):
        problems.append(f"{p['name']}: RSS flat {p['rss_flat']}, threads flat {p['threads_flat']}")
if not r.get("pages_back_to_baseline", False):
    problems.append("KV pages not back to baseline")
a = s.get("answer_check", {})
if a.get("mismatched", 0) > 0:
    problems.append(f"{a['mismatched']} answers differed from the first answer to their prompt: "
                    + "; ".join(a.get("examples", [])))
elif a.get("answers_compared", 0) == 0:
    problems.append("no repeated prompt was answered twice: the answer check compared nothing")
shed = s["errors_by_code"].get("RESOURCE_EXHAUSTED", 0)
print(f"soak: {s['requests']} requests over {s['duration_s']:.0f} s, {s['succeeded']} succeeded, "
      f"{shed} shed (RESOURCE_EXHAUSTED), {len(other) and sum(other.values())} other errors; "
      f"{a.get('answers_compared', 0)} answers compared over {a.get('prompts', 0)} prompts, "
      f"{a.get('mismatched', 0)} differed")
print("soak verdict: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
sys.exit(1 if problems else 0)
PY
verdict_rc=${PIPESTATUS[0]}
set -e
# What malloc says of each node after the warm-up: the first and last samples (MiB).
python3 - "$OUT/memory.csv" "$WARMUP_S" <<'PY' | tee -a "$OUT/verdict.txt"
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if int(r["t_s"]) >= float(sys.argv[2])]
mib = lambda v: float(v) / 2**20
for name in sorted({r["name"] for r in rows}):
    mine = [r for r in rows if r["name"] == name]
    a, b = mine[0], mine[-1]
    print(f"memory {name}: resident {mib(a['resident_bytes']):.1f} -> {mib(b['resident_bytes']):.1f} MiB, "
          f"malloc in use {mib(a['malloc_in_use_bytes']):.1f} -> {mib(b['malloc_in_use_bytes']):.1f}, "
          f"held free {mib(a['malloc_free_held_bytes']):.1f} -> {mib(b['malloc_free_held_bytes']):.1f} "
          f"(t {a['t_s']} -> {b['t_s']} s)")
PY
exit "$verdict_rc"
