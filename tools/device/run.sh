#!/usr/bin/env bash
# The device machine's runs, one named mode per kind of work, parameterised by their arguments
# (several modes chain in one call: `bash tools/device/run.sh tests ... && bash tools/device/run.sh
# bench-decode ...`). Build the bundle here first:
#   ../shared/device/bundle.sh .device build/fluxion build/<test binaries>
#   tar -cJf .device.tar.xz .device        # carry [".device.tar.xz"]
# Every mode that runs a bundle binary sources prologue.sh (OPENBLAS_CORETYPE=SKYLAKEX for the
# host's Xeon, FLUXION_SOURCE_DIR for tests that read models/). Files land in $OUT.
#
#   run.sh tests [BINARY...]
#       the bundle's CUDA test binaries (default: every one run_cuda_tests lists), verdicts only,
#       into $OUT/tests.log (appended)
#   run.sh bench-decode NAME SECONDS ARGS...
#       `fluxion bench decode --device cuda ARGS` for at most SECONDS; the table into
#       $OUT/NAME.log, the results into $OUT/NAME.json (points measured before a timeout stay)
#   run.sh bench-prefill NAME SECONDS ARGS...
#       `fluxion bench prefill --device cuda ARGS` (TTFT with a forked decode side), same files
#   run.sh bench-gpu NAME SECONDS ARGS...
#       `fluxion bench gpu ARGS` (the decode step's kernels against HBM and PCIe probes)
#   run.sh bench-selection NAME SECONDS ARGS...
#       `fluxion bench selection ARGS` (device top-k over compact keys against the HBM probe)
#   run.sh bench-attention NAME SECONDS ARGS...
#       `fluxion bench attention ARGS` on the host's cores (set FLUXION_CPU_ISA to pick kernels)
#   run.sh bench-decode-cpu NAME SECONDS ARGS...
#       `fluxion bench decode ARGS` on the host's cores (the CPU executors)
#   run.sh anchor NAME SECONDS ARGS...
#       torch's whole decode step with the KV in HBM (bench/anchor_hbm_decode.py ARGS)
#   run.sh anchor-prefill NAME SECONDS ARGS...
#       torch's prefill of the same shapes (bench/anchor_prefill.py ARGS)
#   run.sh eval UNITS SECONDS NAME EVAL_ARGS...
#       paired task units on the host's cores (tools/device/xeon_eval.sh; units from
#       tools/device/eval_units.py)
#   run.sh eval-compare [SAMPLES] [CONTEXTS] [THREADS]
#       `fluxion eval tasks` through the CUDA hybrid executor and through the CPU path on the same
#       seeds, then `fluxion eval compare` (docs/TASKS.md, "Decode path"); defaults 10 1024,4096 8
#   run.sh local NAME SECONDS ARGS...
#       `fluxion local --model models/fluxion-tiny-retrieval ARGS` (e.g. --decode-device cuda
#       --prefill-device cuda): the served path on the GPU; its report into $OUT/NAME.log
#   run.sh train SECONDS ARGS...
#       `python3 tools/train/train.py --out /tmp/train ARGS` (no bundle needed: the host's python
#       has torch); its log, results and, with --export DIR, the exported model copied into $OUT/train
#   run.sh tokenizer-refs
#       the HF tokenizer references of tests/data/tokenizers (tools/hf_reference/make_tokenizer_refs.py)
#       as $OUT/tok.tar.gz
mode=${1:?mode: tests, bench-decode, bench-prefill, bench-gpu, bench-selection, bench-attention, bench-decode-cpu, anchor, anchor-prefill, eval, eval-compare, local, train or tokenizer-refs}
shift
here="$(dirname "$0")"

# timed NAME SECONDS COMMAND...: COMMAND for at most SECONDS, its output (without glog's and
# absl's warnings) into $out/NAME.log.
timed() {
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" stdbuf -oL "$@" 2>&1 | grep -v "^W2026\|^WARNING" | tee "$out/$name.log"
}

case "$mode" in
  tests)
    source "$here/prologue.sh"
    if [[ $# -eq 0 ]]; then
      run_cuda_tests
    else
      for t in "$@"; do run_test 300 "$t"; done 2>&1 | tee -a "$out/tests.log"
    fi
    ;;
  bench-decode|bench-prefill)
    name=${1:?NAME}
    seconds=${2:?SECONDS}
    shift 2
    source "$here/prologue.sh"
    timed "$name" "$seconds" "$bin/fluxion" bench "${mode#bench-}" --device cuda "$@" \
      --json "$out/$name.json"
    ;;
  bench-gpu|bench-selection|bench-attention)
    name=${1:?NAME}
    seconds=${2:?SECONDS}
    shift 2
    source "$here/prologue.sh"
    timed "$name" "$seconds" "$bin/fluxion" bench "${mode#bench-}" "$@" --json "$out/$name.json"
    ;;
  bench-decode-cpu)
    name=${1:?NAME}
    seconds=${2:?SECONDS}
    shift 2
    source "$here/prologue.sh"
    timed "$name" "$seconds" "$bin/fluxion" bench decode "$@" --json "$out/$name.json"
    ;;
  anchor|anchor-prefill)
    name=${1:?NAME}
    seconds=${2:?SECONDS}
    shift 2
    out=${OUT:-/tmp/out}
    mkdir -p "$out"
    script=bench/anchor_hbm_decode.py
    [[ $mode == anchor-prefill ]] && script=bench/anchor_prefill.py
    timed "$name" "$seconds" python3 "$script" "$@" --json "$out/$name.json"
    ;;
  eval)
    exec "$here/xeon_eval.sh" "$@"
    ;;
  eval-compare)
    samples=${1:-10}
    contexts=${2:-1024,4096}
    threads=${3:-8}
    source "$here/prologue.sh"
    if [[ -x $bin/eval_cuda_test ]]; then  # its last lines print the measured logit noise
      timeout 120 "$bin/eval_cuda_test" 2>&1 | tail -20 | tee "$out/eval_cuda_test.log"
    fi
    args=(--model models/fluxion-tiny-retrieval --contexts "$contexts" --samples "$samples"
          --policy full,quest,fixed_32_0.05,lfps,fluxion --budget 0.05 --cpu-threads "$threads")
    # Both runs at once, each on THREADS cores: the outcomes do not depend on what else runs.
    for device in cpu cuda; do
      timeout 480 "$bin/fluxion" eval tasks "${args[@]}" --device "$device" \
        --json "$out/eval_$device.json" > "$out/eval_$device.txt" 2>&1 &
    done
    wait
    "$bin/fluxion" eval compare "$out/eval_cpu.json" "$out/eval_cuda.json" \
      --json "$out/eval_compare.json" 2>&1 | tee "$out/eval_compare.txt"
    ;;
  local)
    name=${1:?NAME}
    seconds=${2:?SECONDS}
    shift 2
    source "$here/prologue.sh"
    timed "$name" "$seconds" "$bin/fluxion" local --model models/fluxion-tiny-retrieval "$@"
    cp /tmp/fluxion-local-*/logs/*.log "$out/" 2>/dev/null
    ;;
  train)
    seconds=${1:?SECONDS}
    shift
    out=${OUT:-/tmp/out}
    mkdir -p "$out/train/model"
    PYTHONUNBUFFERED=1 timeout "$seconds" python3 tools/train/train.py --out /tmp/train "$@" 2>&1 |
      grep -v Warning | tail -60
    cp /tmp/train/log.txt /tmp/train/results.json /tmp/train/eval_final.json "$out/train/" 2>/dev/null
    cp /tmp/train/model/config.json /tmp/train/model/model.safetensors "$out/train/model/" 2>/dev/null
    ls -la "$out/train" "$out/train/model"
    ;;
  tokenizer-refs)
    out=${OUT:-/tmp/out}
    mkdir -p "$out/tok"
    python3 tools/hf_reference/make_tokenizer_refs.py "$out/tok" 2>&1 | tail -5
    tar -C "$out" -czf "$out/tok.tar.gz" tok && rm -rf "$out/tok"
    ;;
  *)
    echo "unknown mode $mode (tests, bench-decode, bench-prefill, bench-gpu, bench-attention," \
      "bench-decode-cpu, anchor, anchor-prefill, eval, eval-compare, local, train," \
      "tokenizer-refs)" >&2
    exit 2
    ;;
esac
