#!/usr/bin/env bash
# Paired task tables on the device host's CPU cores: one `fluxion eval tasks --samples 1` process
# per unit on one core, $(nproc) at a time, in file order, until SECONDS have passed.
#   tools/device/xeon_eval.sh UNITS SECONDS NAME EVAL_ARGS...
# UNITS: lines "CONTEXT TASK SEED" (tools/device/eval_units.py writes them, seed-major, so a
# run cut short still holds about as many samples of each task). EVAL_ARGS go to every unit
# (policies, budgets, guard). A unit cut short leaves no JSON: run it again (`--done`), here or on
# the devbox; each prompt's outcomes then all come from one machine, so the pairs hold. Everything
# comes back as one tarball, $OUT/NAME.tar.gz ($OUT returns at most 8 files), with the per-unit
# JSON and logs for tools/eval/merge_runs.py.
# Bundle: ../shared/device/bundle.sh .device build/fluxion; tar -cJf .device.tar.xz .device;
# carry [".device.tar.xz"].
units=$1
seconds=$2
name=$3
shift 3
start=$(date +%s)
source "$(dirname "$0")/prologue.sh"  # out, bin; OPENBLAS_CORETYPE=SKYLAKEX (docs/DEPENDENCIES.md)
work=/tmp/$name
mkdir -p "$work"
echo "nproc $(nproc), OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE, units $(wc -l < "$units")"
run_unit() {
  local ctx=$1 task=$2 seed=$3 unit="$work/$1-$2-$3"
  shift 3
  "$bin/fluxion" eval tasks --model models/fluxion-tiny-retrieval --tasks "$task" \
    --contexts "$ctx" --samples 1 --seed "$seed" --cpu-threads 1 "$@" \
    --json "$unit.json.part" > "$unit.txt" 2>&1 && mv "$unit.json.part" "$unit.json"
}
export -f run_unit
export work bin
left=$(( seconds - ($(date +%s) - start) - 15 ))
echo "eval for ${left}s"
timeout "$left" xargs -a "$units" -P "$(nproc)" -L 1 \
  bash -c 'run_unit "$@" '"$(printf '%q ' "$@")" _
rm -f "$work"/*.json.part
echo "units done: $(ls "$work"/*.json 2>/dev/null | wc -l) of $(wc -l < "$units")"
tar -czf "$out/$name.tar.gz" -C "$work" .
