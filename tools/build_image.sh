#!/usr/bin/env bash
# Builds the Fluxion container image from k8s/image/Dockerfile (docs/DEPLOY.md, "Image"), or checks
# the definition without building it.
#
#   tools/build_image.sh [--demo] [--cuda] [--tag NAME:TAG] [--save FILE.tar]
#       docker build of the runtime stage (fluxion:latest), or with --demo the demo stage
#       (fluxion:demo: the trained tiny model at /opt/fluxion/models/fluxion-tiny-retrieval, for
#       k8s/overlays/dev); --cuda builds with FLUXION_ENABLE_CUDA=ON (fluxion:cuda; needs
#       BUILD_IMAGE / RUNTIME_IMAGE with the CUDA toolkit / runtime: pass them in the environment);
#       --save writes `docker save` output for clusters without a registry
#       (`ctr -n k8s.io images import FILE.tar` on each node, or `kind load image-archive FILE.tar`).
#   tools/build_image.sh --check BINARY
#       no docker needed (CI): every COPY source of the Dockerfile exists, the runtime stage installs
#       a Debian package for every shared library BINARY (a built `fluxion`) links, each of those
#       packages exists in this Debian's archive, and the image's user and entry point are the ones
#       k8s/ runs (uid 10001, /usr/local/bin/fluxion).
set -euo pipefail
cd "$(dirname "$0")/.."
dockerfile=k8s/image/Dockerfile
packages_file=k8s/image/runtime-packages.txt

# The package names of runtime-packages.txt (comments and blank lines dropped).
runtime_packages() { sed -e 's/#.*//' "$packages_file" | tr -s ' \t' '\n' | sed '/^$/d'; }

check() {
  local binary=$1 failed=0
  [[ -x "$binary" ]] || { echo "check: $binary is not an executable"; return 1; }
  # 1. COPY sources exist (relative to the repository root, the build context).
  while read -r src; do
    [[ -e "$src" ]] || { echo "check: COPY source '$src' does not exist"; failed=1; }
  done < <(grep -E '^COPY ' "$dockerfile" | grep -v -- '--from=' | awk '{for (i = 2; i < NF; ++i) print $i}')
  # 2. Every shared library of the binary comes from a runtime package (or the base image's libc).
  mapfile -t wanted < <(runtime_packages)
  local base_packages=" libc6 libgcc-s1 libstdc++6 zlib1g libzstd1 liblzma5 libselinux1 "
  while read -r lib; do
    [[ -n "$lib" ]] || continue
    if [[ "$lib" == "not-found:"* ]]; then
      echo "check: $binary needs ${lib#not-found:}, which is not installed here"
      failed=1
      continue
    fi
    # A CUDA build links the toolkit's libraries (/usr/local/cuda, not Debian's): the CPU image
    # is built with FLUXION_ENABLE_CUDA=OFF and has none; --cuda's RUNTIME_IMAGE must.
    if [[ "$(readlink -f "$lib")" == /usr/local/cuda* || "$(basename "$lib")" =~ ^lib(cuda|cudart|cublas|cublasLt|nvrtc|nvJitLink)\. ]]; then
      echo "check: $(basename "$lib") is CUDA's: in the --cuda image's RUNTIME_IMAGE, not in the CPU image"
      continue
    fi
    local pkg
    pkg=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null | head -n1 | cut -d: -f1) ||
      pkg=$(dpkg -S "$lib" 2>/dev/null | head -n1 | cut -d: -f1) || true
    if [[ -z "$pkg" ]]; then
      echo "check: no Debian package owns $lib (built by hand? the image cannot install it)"
      failed=1
    elif [[ " ${wanted[*]} " != *" $pkg "* && "$base_packages" != *" $pkg "* ]]; then
      echo "check: $lib comes from $pkg, missing from $packages_file"
      failed=1
    fi
  done < <(ldd "$binary" | awk '/=> not found/ {print "not-found:" $1; next} /=> \// {print $3}')
  # 3. Every runtime package exists in the archive (a typo would fail only at image build time).
  for pkg in "${wanted[@]}"; do
    apt-cache show "$pkg" >/dev/null 2>&1 || { echo "check: no Debian package '$pkg'"; failed=1; }
  done
  # 4. What k8s/ relies on: the user the pods run as, the entry point their args follow.
  grep -q '^USER 10001:10001$' "$dockerfile" || { echo "check: the image must run as 10001:10001"; failed=1; }
  grep -q '^ENTRYPOINT \["/usr/local/bin/fluxion"\]$' "$dockerfile" ||
    { echo "check: ENTRYPOINT must be /usr/local/bin/fluxion"; failed=1; }
  grep -q -- '--from=build /build/fluxion /usr/local/bin/fluxion' "$dockerfile" ||
    { echo "check: the runtime stage must copy the built binary to /usr/local/bin/fluxion"; failed=1; }
  for stage in build runtime demo; do
    grep -qE "^FROM .* AS ${stage}\$" "$dockerfile" || { echo "check: no stage '$stage'"; failed=1; }
  done
  if [[ $failed -ne 0 ]]; then return 1; fi
  echo "check: $dockerfile ok (${#wanted[@]} runtime packages cover every library of $binary)"
}

target=runtime tag="" save="" cuda=OFF
while [[ $# -gt 0 ]]; do
  case "$1" in
    --check) check "${2:?--check needs the path of a built fluxion binary}"; exit $? ;;
    --demo) target=demo ;;
    --cuda) cuda=ON ;;
    --tag) tag=${2:?}; shift ;;
    --save) save=${2:?}; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)"; exit 2 ;;
  esac
  shift
done
if [[ -z "$tag" ]]; then
  if [[ $target == demo ]]; then tag=fluxion:demo
  elif [[ $cuda == ON ]]; then tag=fluxion:cuda
  else tag=fluxion:latest
  fi
fi
command -v docker >/dev/null || { echo "docker not found"; exit 1; }
build_args=(--build-arg "FLUXION_ENABLE_CUDA=$cuda")
[[ -n "${BUILD_IMAGE:-}" ]] && build_args+=(--build-arg "BUILD_IMAGE=$BUILD_IMAGE")
[[ -n "${RUNTIME_IMAGE:-}" ]] && build_args+=(--build-arg "RUNTIME_IMAGE=$RUNTIME_IMAGE")
DOCKER_BUILDKIT=1 docker build -f "$dockerfile" --target "$target" "${build_args[@]}" -t "$tag" .
echo "built $tag"
if [[ -n "$save" ]]; then
  docker save -o "$save" "$tag"
  echo "saved $tag to $save (load with: docker load -i $save, or ctr -n k8s.io images import $save)"
fi
