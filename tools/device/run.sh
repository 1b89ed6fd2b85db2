#!/usr/bin/env bash
# The device machine's runs, one named mode per kind of work, parameterised by their arguments
# (several modes chain in one call: `bash tools/device/run.sh tests ... && bash tools/device/run.sh
# bench-decode ...`). Build the bundle here first:
#   ../shared/device/bundle.sh .device build/fluxion build/<test binaries>
#   tar -cJf .device.tar.xz .device        # carry [".device.tar.xz"]
#
#   run.sh tests [BINARY...]
#       the bundle's CUDA test binaries (default: every one run_cuda_tests lists), verdicts only,
#       into $OUT/tests.log (appended)
#   run.sh bench-decode NAME SECONDS ARGS...
#       `fluxion bench decode --device cuda ARGS` for at most SECONDS; the table into
#       $OUT/NAME.log, the results into $OUT/NAME.json (points measured before a timeout stay)
#   run.sh eval UNITS SECONDS NAME EVAL_ARGS...
#       paired task units on the host's cores (tools/device/xeon_eval.sh)
mode=${1:?mode: tests, bench-decode or eval}
shift
here="$(dirname "$0")"
case "$mode" in
  tests)
    source "$here/prologue.sh"
    if [[ $# -eq 0 ]]; then
      run_cuda_tests
    else
      for t in "$@"; do run_test 300 "$t"; done 2>&1 | tee -a "$out/tests.log"
    fi
    ;;
  bench-decode)
    name=${1:?NAME}
    seconds=${2:?SECONDS}
    shift 2
    source "$here/prologue.sh"
    timeout "$seconds" "$bin/fluxion" bench decode --device cuda "$@" --json "$out/$name.json" \
      2>&1 | grep -v "^W2026\|^WARNING" | tee "$out/$name.log"
    ;;
  eval)
    exec "$here/xeon_eval.sh" "$@"
    ;;
  *)
    echo "unknown mode $mode (tests, bench-decode, eval)" >&2
    exit 2
    ;;
esac
