#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (build-fuzz/) and runs each for SECONDS (default 300)
# over its committed corpus, tests/fuzz/corpus/<target>/. New interesting inputs go to
# build-fuzz/fuzz-corpus/<target>/ (not committed; copy small useful ones into the seed corpus);
# a crash stops that target, leaves crash-*/leak-*/timeout-* in build-fuzz/fuzz-artifacts/, and
# makes the script exit 1 after the remaining targets ran. docs/FUZZING.md.
#
#   tools/fuzz.sh [SECONDS] [TARGET...]     e.g. tools/fuzz.sh 600 config_fuzz
#   FLUXION_FUZZ_JOBS=N                      run N targets at once (default 1)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-300}"
shift || true
root="$(pwd)"
build="${FLUXION_FUZZ_BUILD:-$root/build-fuzz}"

if [[ ! -f "$build/build.ninja" ]]; then
  launcher=()
  if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  fi
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DFLUXION_FUZZ=ON \
    -DFLUXION_ENABLE_CUDA=OFF -DFLUXION_BUILD_TESTS=OFF "${launcher[@]}" >/dev/null
fi
mapfile -t all < <(ninja -C "$build" -t targets all | sed -n 's/^\([a-z_0-9]*_fuzz\): phony$/\1/p' |
  grep -v '^cmake_' | sort -u)
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then targets=("${all[@]}"); fi
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"

# -rss_limit_mb: every allocation is bounded by the input limits (docs/FUZZING.md); 2 GiB is far
# above any legal input and catches one that is not. -timeout: one input taking 10 s is a hang.
run_one() {
  local t="$1" bin corpus work dict=()
  bin="$(find "$build" -name "$t" -type f -perm -u+x | head -1)"
  corpus="$root/tests/fuzz/corpus/$t"
  work="$build/fuzz-corpus/$t"
  mkdir -p "$work" "$build/fuzz-artifacts"
  case "$t" in config_fuzz|safetensors_fuzz|trace_fuzz) dict=(-dict="$root/tests/fuzz/json.dict") ;; esac
  if "$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
      "${dict[@]}" -artifact_prefix="$build/fuzz-artifacts/$t-" "$work" "$corpus" \
      >"$build/fuzz-artifacts/$t.log" 2>&1; then
    echo "fuzz: $t ok ($(grep -o 'stat::number_of_executed_units: *[0-9]*' \
      "$build/fuzz-artifacts/$t.log" | grep -o '[0-9]*$') runs in ${seconds}s)"
  else
    echo "fuzz: $t FAILED; log: $build/fuzz-artifacts/$t.log" >&2
    grep -E 'ERROR|runtime error|SUMMARY|Test unit written' "$build/fuzz-artifacts/$t.log" >&2 || true
    return 1
  fi
}

failed=0
jobs="${FLUXION_FUZZ_JOBS:-1}"
pids=()
for t in "${targets[@]}"; do
  run_one "$t" & pids+=($!)
  if [[ ${#pids[@]} -ge $jobs ]]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
exit $failed
