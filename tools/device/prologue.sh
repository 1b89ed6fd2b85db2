# Sourced by the device scripts (tools/device/*.sh, from session 10 on): the output folder, the
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
