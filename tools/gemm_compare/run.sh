#!/usr/bin/env bash
# Builds and runs the OpenBLAS-vs-oneDNN comparison (installs Debian's libdnnl-dev for it; the
# product does not depend on oneDNN). Prints a table; ratio = oneDNN time / OpenBLAS time.
set -euo pipefail
cd "$(dirname "$0")"
dpkg-query -W -f='${Status}' libdnnl-dev 2>/dev/null | grep -q "install ok installed" ||
  apt-get install -y -qq --no-install-recommends libdnnl-dev
g++ -O2 -std=c++17 -fopenmp gemm_compare.cc -o /tmp/gemm_compare \
  $(pkg-config --cflags --libs openblas) -ldnnl
/tmp/gemm_compare
