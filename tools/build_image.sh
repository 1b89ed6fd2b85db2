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
  # 2. Every shared library of the binary comes from a runtime package or one of their
  #    dependencies (apt installs those too), or from the base image.
  mapfile -t wanted < <(runtime_packages)
  local base_packages=" libc6 libgcc-s1 libstdc++6 zlib1g libzstd1 liblzma5 libselinux1 "
  local installed
  installed=" $(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
      --no-breaks --no-replaces --no-enhances "${wanted[@]}" 2>/dev/null |
      grep -E '^[a-z0-9]' | sed 's/:.*//' | sort -u | tr '\n' ' ') "
  # One dpkg -S for every library, under each path dpkg may know it by (merged /usr: a package
  # installed it as /lib/... or /usr/lib/...): "package: path" lines.
  local libs=() missing=() candidates=()
  while read -r kind lib; do
    if [[ $kind == missing ]]; then missing+=("$lib"); else libs+=("$lib"); fi
  done < <(ldd "$binary" | awk '/=> not found/ {print "missing", $1; next} /=> \// {print "found", $3}')
  local lib real
  for lib in "${libs[@]}"; do
    real=$(readlink -f "$lib")
    candidates+=("$lib" "$real" "${lib#/usr}" "${real#/usr}" "/usr$lib" "/usr$real")
  done
  declare -A owner=()
  local line
  while IFS= read -r line; do
    owner["${line#*: }"]=${line%%: *}
  done < <(dpkg -S "${candidates[@]}" 2>/dev/null | sed 's/:[a-z0-9]*: /: /' || true)
  for lib in "${missing[@]}" "${libs[@]}"; do
    local name pkg=""
    name=$(basename "$lib")
    real=$(readlink -f "$lib" 2>/dev/null || echo "$lib")
    # A CUDA build links the toolkit's libraries (/usr/local/cuda, not Debian's): the CPU image
    # is built with FLUXION_ENABLE_CUDA=OFF and has none; --cuda's RUNTIME_IMAGE must.
    if [[ "$real" == /usr/local/cuda* || "$name" =~ ^lib(cuda|cudart|cublas|cublasLt|nvrtc|nvJitLink)\. ]]; then
      echo "check: $name is CUDA's: in the --cuda image's RUNTIME_IMAGE, not in the CPU image"
      continue
    fi
    if [[ " ${missing[*]} " == *" $lib "* ]]; then
      echo "check: $binary needs $lib, which is not installed here"
      failed=1
      continue
    fi
    local candidate
    for candidate in "$lib" "$real" "${lib#/usr}" "${real#/usr}" "/usr$lib" "/usr$real"; do
      [[ -z "$pkg" ]] && pkg=${owner[$candidate]:-}
    done
    if [[ -z "$pkg" ]]; then
      echo "check: no Debian package owns $lib (built by hand? the image cannot install it)"
      failed=1
    elif [[ "$installed" != *" $pkg "* && "$base_packages" != *" $pkg "* ]]; then
      echo "check: $lib comes from $pkg, which $packages_file does not install"
      failed=1
    fi
  done
  # 3. Every runtime package exists in the archive (a typo would fail only at image build time).
  local known
  known=" $(apt-cache show --no-all-versions "${wanted[@]}" 2>/dev/null | sed -n 's/^Package: //p' |
      tr '\n' ' ') "
  for pkg in "${wanted[@]}"; do
    [[ "$known" == *" $pkg "* ]] || { echo "check: no Debian package '$pkg'"; failed=1; }
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
