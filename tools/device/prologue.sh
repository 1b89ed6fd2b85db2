# Sourced by tools/device/run.sh and xeon_eval.sh: the output folder, the
# carried bundle unpacked once, its environment, and the settings every run there uses.
#   out  the folder whose files come back ($OUT on the device machine)
#   bin  the bundle's executables
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/dev
[[ -d /tmp/dev/.device ]] || tar -C /tmp/dev -xJf .device.tar.xz
source /tmp/dev/.device/env.sh
bin=/tmp/dev/.device/bin
# OpenBLAS misdetects the host's Xeon; SKYLAKEX triples CPU prefill there (docs/DEPENDENCIES.md).
# FLUXION_SOURCE_DIR: tests that read models/ find the checkout.
export OPENBLAS_CORETYPE=SKYLAKEX FLUXION_SOURCE_DIR=$PWD
# run_test SECONDS NAME: one test binary of the bundle, its verdict lines only.
run_test() {
  echo "== $2"
  timeout "$1" "$bin/$2" 2>&1 |
    grep -E '^\[ +(FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|Expected|Which is' | tail -25
}
# run_cuda_tests: every CUDA test binary of the bundle, the prefill's first, into $out/tests.log.
run_cuda_tests() {
  {
    run_test 120 prefill_device_test
    run_test 120 kernels_cuda_prefill_test
    run_test 120 kernels_cuda_test
    run_test 60 kernels_cuda_ring_test
    run_test 180 kernels_cuda_attention_test
    run_test 120 model_cuda_test
    run_test 90 cuda_resident_window_test
    run_test 150 eval_cuda_test
  } 2>&1 | tee "$out/tests.log"
}
