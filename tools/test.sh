#!/usr/bin/env bash
# The README's second command: set up, build everything, run the test suite.
# GPU tests (ctest label "cuda") skip cleanly on machines without a CUDA device.
#
# Stages (each prints its wall time; docs/FUZZING.md):
#   1. build (build/), unit + eval + cuda tests
#   2. integration tests (each runs once: a test that needs a second attempt is a bug)
#   3. fuzz: the libFuzzer targets built with clang (build-fuzz/), each run for
#      FLUXION_CI_FUZZ_SECONDS (default 20) over its committed corpus; a crash fails CI
#   4. sanitizers: the unit tests built with AddressSanitizer + UndefinedBehaviorSanitizer
#      (build-asan/, -fno-sanitize-recover: UB fails the test) and run there
#   5. the container image: a CPU-only Release `fluxion` (build-image/), the runtime image around
#      it (tools/build_image.sh --prebuilt, daemonless with buildah, the Debian base made from
#      Debian's mirror) and its smoke checks run inside it (docs/DEPLOY.md, "Image")
# FLUXION_CI_SKIP_FUZZ=1 / FLUXION_CI_SKIP_SANITIZERS=1 / FLUXION_CI_SKIP_IMAGE=1 leave stage 3 /
# 4 / 5 out (local runs).
#
# Measured here (2 cores, Debian 12) on 2026-12-01 while other jobs built on the same
# cores (load average ~10), cold ccache; a dedicated CI box is several times faster:
#   stage 3  build of the 7 fuzz targets and their instrumented libraries: 1012 s (clang, cold);
#            running them, corpus + 20 s each: 172 s
#   stage 4  configure 10 s; build of the whole unit_tests target with ASan+UBSan (gcc, cold):
#            ~3500 s at that load (1500 s for the first 31 of 132 steps, 1983 s for the rest);
#            running the 481 unit tests under ASan+UBSan, -j2: 77 s
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
jobs="$(nproc)"
stage_start=$SECONDS
stage() {  # stage NAME: prints the time the previous stage took
  echo "== test.sh: $1 (previous stage took $((SECONDS - stage_start)) s, $SECONDS s in all)"
  stage_start=$SECONDS
}

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  # Paths relative to the checkout and no working directory in the hash: a fresh clone in another
  # folder (as CI makes) still hits the cache of the previous run, for build/ (nvcc included:
  # ccache >= 4 handles it) as for build-fuzz and build-asan.
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
fi

stage "build and unit tests"
cuda_launcher=()
[[ ${#launcher[@]} -gt 0 ]] && cuda_launcher=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLUXION_BUILD_TESTS=ON "${launcher[@]}" \
  "${cuda_launcher[@]}" >/dev/null
cmake --build build -j"$jobs"
# Every test runs once, without retries: a test that passes only on a second attempt hides a bug in
# itself or in the code. The integration tests start real processes (gRPC servers, UCX peers, the
# router) on a machine they share with the rest of the suite, so none of them asserts how fast
# something happened: they wait for conditions with generous deadlines (common/wait_testing.h) and
# assert the order of events and the lower bounds the code causes (README.md, "Tests").
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 600 -LE integration

stage "integration tests"
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 600 -L integration

if [[ "${FLUXION_CI_SKIP_FUZZ:-0}" != 1 ]]; then
  stage "fuzz targets (clang, libFuzzer)"
  # Every committed corpus file (seeds and past crashes) must pass, then each target mutates for
  # a bounded time. Longer runs by hand: tools/fuzz.sh 600.
  ./tools/fuzz.sh "${FLUXION_CI_FUZZ_SECONDS:-20}"
fi

if [[ "${FLUXION_CI_SKIP_SANITIZERS:-0}" != 1 ]]; then
  stage "unit tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  # CUDA off: nvcc does not take -fsanitize, and the cuda tests skip without a device anyway.
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLUXION_BUILD_TESTS=ON \
    -DFLUXION_ENABLE_CUDA=OFF -DFLUXION_SANITIZE=address,undefined "${launcher[@]}" >/dev/null
  cmake --build build-asan -j"$jobs" --target unit_tests
  # Third-party libraries (gRPC, protobuf, OpenBLAS, UCX) are not instrumented: ASan still checks
  # our accesses into their buffers. Leak checking stays on. Left out, with the reason:
  #  - tools_eval, cluster_k8s_kustomize: Python / shell, no C++ to check.
  #  - GrpcStatusTest.NonCanonicalGrpcCodeBecomesUnknownNamingTheNumber: it builds a grpc::Status
  #    holding code 42 (what an odd peer can send) and gRPC's own header (grpcpp status.h:126,
  #    Status::ok()) loads it as enum StatusCode, whose range is 0..31: UBSan reports an invalid
  #    enum load inside the third-party header. Every accessor of the code loads the enum, so our
  #    conversion (common/grpc_status.cc) cannot avoid it; the test passes in the normal build.
  #    -fno-sanitize-recover makes UBSan's suppression files inapplicable, hence -E.
  # Leak checking skips what tools/lsan.supp names (third-party allocations, each with a reason).
  LSAN_OPTIONS="suppressions=$PWD/tools/lsan.supp:print_suppressions=0" \
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=0" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" --timeout 900 -L unit \
      -E '^(tools_eval|cluster_k8s_kustomize|GrpcStatusTest\.NonCanonicalGrpcCodeBecomesUnknownNamingTheNumber)$'
fi

if [[ "${FLUXION_CI_SKIP_IMAGE:-0}" != 1 ]]; then
  stage "container image (build-image/, buildah)"
  # CUDA off: the CPU image carries no CUDA libraries (build/'s binary links them). Release, no
  # tests: the binary the image's own Dockerfile build makes.
  cmake -S . -B build-image -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLUXION_BUILD_TESTS=OFF \
    -DFLUXION_ENABLE_CUDA=OFF "${launcher[@]}" >/dev/null
  cmake --build build-image -j"$jobs" --target fluxion
  ./tools/build_image.sh --check build-image/fluxion
  ./tools/build_image.sh --builder buildah --local-base --prebuilt build-image/fluxion --smoke
fi
stage "done"
