#!/usr/bin/env bash
# Builds the Fluxion container image from k8s/image/Dockerfile (docs/DEPLOY.md, "Image"), or checks
# the definition without building it.
#
#   tools/build_image.sh [--demo | --prebuilt BINARY] [--cuda] [--tag NAME:TAG] [--save FILE.tar]
#                        [--builder docker|buildah|podman] [--local-base] [--smoke]
#       builds the runtime stage (fluxion:latest), or with --demo the demo stage
#       (fluxion:demo: the trained tiny model at /opt/fluxion/models/fluxion-tiny-retrieval, for
#       k8s/overlays/dev); --cuda builds with FLUXION_ENABLE_CUDA=ON (fluxion:cuda; needs
#       BUILD_IMAGE / RUNTIME_IMAGE with the CUDA toolkit / runtime: pass them in the environment);
#       --save writes a docker-archive file for clusters without a registry
#       (`ctr -n k8s.io images import FILE.tar` on each node, or `kind load image-archive FILE.tar`).
#       --builder: default docker when its daemon answers, else buildah, else podman (both
#       daemonless; they build as root here, with chroot isolation when the OCI runtime cannot start
#       a container). --local-base: no registry reachable, so make the two base images from
#       Debian's package mirror with mmdebstrap (localhost/debian:12 and localhost/debian:12-slim,
#       made once, reused after) and build FROM them instead of Docker Hub's debian:12 / 12-slim.
#       --prebuilt BINARY: the runtime image around a CPU `fluxion` built outside the image (target
#       `prebuilt`, tag fluxion:prebuilt; what CI builds after its tests, without a second
#       compile). --smoke: then run the image's checks inside a container of it (buildah or
#       podman): it runs as uid 10001, cannot write its root filesystem, every library the
#       binary links resolves, and `fluxion --help` and a `fluxion generate` on a random model
#       made inside it work.
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
  done < <(grep -E '^COPY ' "$dockerfile" | grep -v -- '--from=' | awk '{for (i = 2; i < NF; ++i) print $i}' |
      grep -v '^\.image-prebuilt/')   # put there by --prebuilt
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
  for stage in build runtime-base runtime demo prebuilt; do
    grep -qE "^FROM .* AS ${stage}\$" "$dockerfile" || { echo "check: no stage '$stage'"; failed=1; }
  done
  if [[ $failed -ne 0 ]]; then return 1; fi
  echo "check: $dockerfile ok (${#wanted[@]} runtime packages cover every library of $binary)"
}

# The builder: docker only when a daemon answers (the client alone cannot build), else the
# daemonless buildah or podman.
pick_builder() {
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker
  elif command -v buildah >/dev/null; then echo buildah
  elif command -v podman >/dev/null; then echo podman
  else echo "no builder: docker (with a daemon), buildah or podman is needed" >&2; return 1
  fi
}

# buildah/podman run RUN steps through the OCI runtime (crun/runc) by default. Where it cannot start
# a container (the devbox's crun fails on setrlimit RLIMIT_NOFILE/NPROC inside its VM sandbox),
# chroot isolation runs them in a chroot of the layer with the host's network, which is all the
# Dockerfile's RUN steps need (apt-get from Debian's mirror, a compiler).
pick_isolation() {
  local base=$1 ctr isolation=chroot
  ctr=$(buildah from --pull=never "$base" 2>/dev/null) || { echo "$isolation"; return; }
  if buildah run --isolation oci "$ctr" true >/dev/null 2>&1; then isolation=oci; fi
  buildah rm "$ctr" >/dev/null
  echo "$isolation"
}

# Whether the builder's local storage holds IMAGE.
have_image() {
  case "$builder" in
    docker) docker image inspect "$1" >/dev/null 2>&1 ;;
    *) "$builder" image exists "$1" 2>/dev/null || "$builder" inspect --type image "$1" >/dev/null 2>&1 ;;
  esac
}

# The Debian 12 base images from Debian's package mirror (the one `apt-get` uses), for machines
# that reach no registry. Made like the official images (debuerreotype): variant minbase with the
# bookworm, bookworm-updates and bookworm-security suites; apt keeps no .debs, no package lists and
# no translations; policy-rc.d stops services from starting at install. The slim one also leaves
# out docs, man pages and locales for every package installed later (dpkg path-exclude, kept in the
# image as /etc/dpkg/dpkg.cfg.d/99mmdebstrap).
make_local_base() {
  local name=$1 slim=$2 dir tar
  command -v mmdebstrap >/dev/null || { echo "--local-base needs mmdebstrap (apt-get install mmdebstrap)"; return 1; }
  dir=$(mktemp -d "${TMPDIR:-/tmp}/fluxion-base.XXXXXX")
  tar=$dir/rootfs.tar
  local opts=(--mode=root --variant=minbase --format=tar --skip=cleanup/apt
    # merged /usr made by the hook, as debuerreotype does, instead of the usrmerge package, which
    # pulls in perl (47 MB) that neither image needs.
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    --aptopt='APT::Install-Recommends "false"'
    # mmdebstrap's own cleanup leaves apt's 70 MB pkgcache.bin/srcpkgcache.bin: clean by hand.
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb "$1"/var/cache/debconf/*-old'
    --customize-hook='printf "#!/bin/sh\nexit 101\n" > "$1/usr/sbin/policy-rc.d"; chmod 755 "$1/usr/sbin/policy-rc.d"'
    --customize-hook='printf "DPkg::Post-Invoke { \"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true\"; };\nAPT::Update::Post-Invoke { \"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true\"; };\nDir::Cache::pkgcache \"\";\nDir::Cache::srcpkgcache \"\";\n" > "$1/etc/apt/apt.conf.d/docker-clean"'
    --customize-hook='printf "Acquire::Languages \"none\";\n" > "$1/etc/apt/apt.conf.d/docker-no-languages"')
  if [[ $slim == slim ]]; then
    local path
    for path in man doc info locale groff lintian linda; do opts+=(--dpkgopt="path-exclude=/usr/share/$path/*"); done
    opts+=(--dpkgopt='path-include=/usr/share/doc/*/copyright')
  fi
  echo "making $name from Debian's mirror (mmdebstrap)"
  # The tar is hundreds of MB: removed whether the build or the import fails or not.
  local rc=0
  nice -n 10 mmdebstrap "${opts[@]}" bookworm "$tar" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main" &&
    import_rootfs "$tar" "$name" || rc=$?
  rm -rf "$dir"
  [[ $rc -eq 0 ]] || echo "making $name failed (exit $rc)" >&2
  return "$rc"
}

# One image from a root filesystem tar, CMD bash as Debian's images have. buildah has no `import`:
# a scratch container with the tar added (buildah add unpacks a local tar) and committed.
import_rootfs() {
  local tar=$1 name=$2 ctr
  case "$builder" in
    docker|podman) "$builder" import --change 'CMD ["bash"]' "$tar" "$name" ;;
    buildah)
      ctr=$(buildah from scratch)
      buildah add "$ctr" "$tar" /
      buildah config --cmd bash "$ctr"
      buildah commit --rm "$ctr" "$name" ;;
  esac
}

# Builds the Dockerfile's TARGET as TAG with the chosen builder. --layers: buildah and podman then
# reuse the build stage's layers (the 15-25 min compile) between the runtime and demo targets, as
# docker does.
build() {
  local build_args=(--build-arg "FLUXION_ENABLE_CUDA=$cuda")
  [[ -n "${BUILD_IMAGE:-}" ]] && build_args+=(--build-arg "BUILD_IMAGE=$BUILD_IMAGE")
  [[ -n "${RUNTIME_IMAGE:-}" ]] && build_args+=(--build-arg "RUNTIME_IMAGE=$RUNTIME_IMAGE")
  case "$builder" in
    docker)
      DOCKER_BUILDKIT=1 docker build -f "$dockerfile" --target "$target" "${build_args[@]}" -t "$tag" . ;;
    buildah|podman)
      local isolation pull=()
      isolation=$(pick_isolation "${RUNTIME_IMAGE:-debian:12-slim}")
      [[ $local_base == 1 ]] && pull=(--pull=never)   # the bases are local; there is no registry
      echo "$builder: isolation $isolation"
      if [[ $builder == buildah ]]; then
        buildah bud --layers --isolation "$isolation" "${pull[@]}" -f "$dockerfile" --target "$target" \
          "${build_args[@]}" -t "$tag" .
      else
        podman build --layers --isolation "$isolation" "${pull[@]}" -f "$dockerfile" --target "$target" \
          "${build_args[@]}" -t "$tag" .
      fi ;;
  esac
}

# Writes TAG as a docker-archive tar (what `docker load`, `ctr images import` and kind read).
save_image() {
  case "$builder" in
    docker) docker save -o "$save" "$tag" ;;
    buildah) rm -f "$save"; buildah push "$tag" "docker-archive:$save:$tag" ;;
    podman) podman save --format docker-archive -o "$save" "$tag" ;;
  esac
  echo "saved $tag to $save (load with: docker load -i $save, or ctr -n k8s.io images import $save)"
}

# Puts the --prebuilt binary where the Dockerfile's `prebuilt` stage copies it from, stripped of
# debug information (the build's RelWithDebInfo binary is ~130 MB with it). A binary linking CUDA
# cannot go into the CPU image: refused with the reason.
stage_prebuilt() {
  local binary=$1
  [[ -x "$binary" ]] || { echo "--prebuilt: $binary is not an executable"; return 1; }
  if ldd "$binary" | grep -qE 'libcudart|libcublas'; then
    echo "--prebuilt: $binary links CUDA; the CPU image needs a build with -DFLUXION_ENABLE_CUDA=OFF"
    return 1
  fi
  rm -rf .image-prebuilt
  mkdir -p .image-prebuilt
  cp "$binary" .image-prebuilt/fluxion
  strip --strip-debug .image-prebuilt/fluxion
}

# The image's own checks, run inside a container of it as its user (chroot isolation where the OCI
# runtime cannot start one, as for the build).
smoke() {
  [[ $builder == docker ]] && { echo "--smoke runs with buildah or podman"; return 1; }
  local ctr rc=0 isolation
  isolation=$(pick_isolation "$tag")
  ctr=$(buildah from --pull=never "$tag")
  in_image() { buildah run --isolation "$isolation" "$ctr" -- "$@"; }
  echo "smoke: $tag (isolation $isolation)"
  [[ "$(in_image id -u)" == 10001 ]] || { echo "smoke: not running as uid 10001"; rc=1; }
  if in_image sh -c 'touch /usr/smoke-test' 2>/dev/null; then
    echo "smoke: the image's user can write /usr"; rc=1
  fi
  if in_image ldd /usr/local/bin/fluxion | grep -q 'not found'; then
    in_image ldd /usr/local/bin/fluxion | grep 'not found'
    echo "smoke: libraries missing from the image"; rc=1
  fi
  in_image /usr/local/bin/fluxion --help >/dev/null || { echo "smoke: fluxion --help failed"; rc=1; }
  # The model math in the image: a random tiny model written and read back in /tmp (writable in
  # a container, as the pods' emptyDir is), 8 greedy tokens.
  if ! in_image sh -c '/usr/local/bin/fluxion make-model --preset tiny --seed 1 --out /tmp/m >/dev/null &&
        /usr/local/bin/fluxion generate --model /tmp/m --prompt-ids 1,2,3,4 --max-tokens 8 \
          --cpu-threads 1 >/dev/null'; then
    echo "smoke: fluxion generate on a random model failed"; rc=1
  fi
  buildah rm "$ctr" >/dev/null
  [[ $rc -eq 0 ]] && echo "smoke: ok"
  return "$rc"
}

target=runtime tag="" save="" cuda=OFF builder="" local_base=0 prebuilt="" run_smoke=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --check) check "${2:?--check needs the path of a built fluxion binary}"; exit $? ;;
    --demo) target=demo ;;
    --prebuilt) target=prebuilt prebuilt=${2:?--prebuilt needs the path of a built fluxion}; shift ;;
    --smoke) run_smoke=1 ;;
    --cuda) cuda=ON ;;
    --tag) tag=${2:?}; shift ;;
    --save) save=${2:?}; shift ;;
    --builder) builder=${2:?}; shift ;;
    --local-base) local_base=1 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)"; exit 2 ;;
  esac
  shift
done
if [[ -z "$tag" ]]; then
  if [[ $target == demo ]]; then tag=fluxion:demo
  elif [[ $target == prebuilt ]]; then tag=fluxion:prebuilt
  elif [[ $cuda == ON ]]; then tag=fluxion:cuda
  else tag=fluxion:latest
  fi
fi
[[ -n "$builder" ]] || builder=$(pick_builder)
case "$builder" in docker|buildah|podman) ;; *) echo "unknown builder $builder"; exit 2 ;; esac
command -v "$builder" >/dev/null || { echo "$builder not found"; exit 1; }
if [[ $local_base == 1 ]]; then
  [[ $cuda == ON ]] && { echo "--local-base makes the CPU bases; --cuda needs BUILD_IMAGE/RUNTIME_IMAGE with CUDA"; exit 2; }
  # localhost/, not debian:12: the bases made here must not pass for Docker Hub's images.
  export BUILD_IMAGE=localhost/debian:12 RUNTIME_IMAGE=localhost/debian:12-slim
  # The prebuilt image needs only the runtime base.
  [[ $target == prebuilt ]] || have_image "$BUILD_IMAGE" || make_local_base "$BUILD_IMAGE" full
  have_image "$RUNTIME_IMAGE" || make_local_base "$RUNTIME_IMAGE" slim
fi
if [[ -n "$prebuilt" ]]; then
  trap 'rm -rf .image-prebuilt' EXIT
  stage_prebuilt "$prebuilt"
fi
echo "building $tag (target $target) with $builder"
build
echo "built $tag"
if [[ -n "$save" ]]; then save_image; fi
if [[ $run_smoke == 1 ]]; then smoke; fi
