#!/usr/bin/env bash
# Builds and tests Tessera's container images (deploy/docker/Dockerfile) with buildah, on a
# machine with no container daemon and no registry (docs/image.md).
#
#   scripts/image.sh build [cpu|gpu|all]   make the images (default all)
#   scripts/image.sh test  [cpu|gpu|all]   make them unless present, then test them inside
#
# It installs buildah and debootstrap (scripts/bootstrap.sh --image-tools), makes the Debian 12
# base image with debootstrap (scripts/image_base.sh), downloads the torch wheels once into
# .whl/ and builds from them with no index, mounts this machine's CUDA toolkit into the GPU
# build when it has one, and lends the build this machine's ccache (read-only).
#
# Environment:
#   IMAGE_NAME         image repository (default localhost/tessera; tags :cpu and :gpu)
#   IMAGE_BASE         base image; default localhost/tessera-debian:bookworm (made here), or
#                      e.g. debian:bookworm where a registry is reachable
#   IMAGE_REBUILD=1    test: rebuild even when the images exist (build always rebuilds,
#                      reusing buildah's layer cache)
#   IMAGE_PIP=pypi     pip inside the build from PyPI (this machine's CA bundle mounted)
#                      instead of the wheels in .whl/
#   CUDA_TOOLKIT       apt or mounted (default: mounted when /usr/local/cuda/bin/nvcc exists)
#   IMAGE_CONTEXT      worktree (default: the checkout as it is, as `docker build .`) or a git
#                      revision, e.g. HEAD: build that commit alone (git archive), without
#                      uncommitted edits
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
action="${1:-build}"
which="${2:-all}"
name="${IMAGE_NAME:-localhost/tessera}"
base="${IMAGE_BASE:-localhost/tessera-debian:bookworm}"
torch_version=$(sed -n 's/^readonly TORCH_VERSION="\(.*\)"/\1/p' scripts/bootstrap.sh)
timings=()
context="$repo"
if [[ -n "${IMAGE_CONTEXT:-}" && "${IMAGE_CONTEXT}" != worktree ]]; then
  context=$(mktemp -d /var/tmp/tessera-context.XXXXXX)
  trap 'rm -rf "$context"' EXIT
  git archive "$IMAGE_CONTEXT" | tar -x -C "$context"
fi
log() { echo "image: $*" >&2; }

case "$which" in all) targets=(cpu gpu) ;; cpu | gpu) targets=("$which") ;;
  *) echo "usage: $0 build|test [cpu|gpu|all]" >&2; exit 2 ;; esac

timed() {  # label, command...
  local label="$1" start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  timings+=("$(printf '%-48s %5ds' "$label" $((SECONDS - start)))")
  return $rc
}

ensure_tools() {
  command -v buildah >/dev/null && command -v debootstrap >/dev/null && return 0
  scripts/bootstrap.sh --image-tools
}

ensure_base() {
  [[ "$base" == localhost/tessera-debian:* ]] || return 0
  scripts/image_base.sh "$base"
}

# The torch wheel and its dependencies, once per pin, for a build without an index.
ensure_wheels() {
  [[ "${IMAGE_PIP:-wheels}" == pypi ]] && return 0
  local marker=".whl/.torch-$torch_version-complete"
  [[ -f "$marker" ]] && return 0
  local venv="${TESSERA_CACHE_DIR:-$HOME/.cache/tessera}/image-pip"
  [[ -x "$venv/bin/pip" ]] || python3 -m venv "$venv"
  log "downloading torch==$torch_version and its wheels into .whl/ (once)"
  mkdir -p .whl
  nice -n 10 "$venv/bin/pip" download -q --disable-pip-version-check --dest .whl \
    "torch==$torch_version" numpy
  touch "$marker"
}

build_one() {  # target
  local target="$1" args=()
  args+=(--build-arg "BASE_IMAGE=$base" --build-arg "RUNTIME_IMAGE=$base")
  # What --version reports: the build context has no .git.
  local commit=""
  if [[ -n "${IMAGE_CONTEXT:-}" ]]; then
    commit=$(git -C "$repo" rev-parse --short=12 "$IMAGE_CONTEXT" 2>/dev/null || true)
  else
    commit=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || true)
    if [[ -n "$commit" ]] && ! git -C "$repo" diff --quiet HEAD 2>/dev/null; then
      commit="$commit-dirty"
    fi
  fi
  args+=(--build-arg "GIT_COMMIT=$commit")
  if [[ "${IMAGE_PIP:-wheels}" == pypi ]]; then
    args+=(-v "$(readlink -f /etc/ssl/certs/ca-certificates.crt):/run/host-ca.pem:ro"
           --build-arg "PIP_INSTALL_ARGS=--cert /run/host-ca.pem")
  else
    args+=(-v "$repo/.whl:/wheels:ro" --build-arg "PIP_INSTALL_ARGS=--no-index --find-links /wheels")
  fi
  local ccache_dir="${CCACHE_DIR:-$HOME/.cache/ccache}"
  if [[ -d "$ccache_dir" ]]; then
    args+=(-v "$ccache_dir:/host-ccache:ro" --build-arg "CCACHE_REMOTE_STORAGE=file:/host-ccache|read-only")
  fi
  if [[ "$target" == gpu ]]; then
    local toolkit="${CUDA_TOOLKIT:-}"
    if [[ -z "$toolkit" ]]; then
      [[ -x /usr/local/cuda/bin/nvcc ]] && toolkit=mounted || toolkit=apt
    fi
    args+=(--build-arg "CUDA_TOOLKIT=$toolkit")
    [[ "$toolkit" == mounted ]] && args+=(-v "$(readlink -f /usr/local/cuda):/usr/local/cuda:ro")
  fi
  log "building $name:$target from ${IMAGE_CONTEXT:-worktree}"
  nice -n 10 buildah bud --isolation chroot --layers --format docker \
    -f "$context/deploy/docker/Dockerfile" --target "$target" "${args[@]}" -t "$name:$target" \
    "$context"
}

image_size() { buildah images --format '{{.Size}}' "$1" | head -n 1; }

build_all() {
  timed "tools" ensure_tools
  timed "base image ($base)" ensure_base
  timed "torch wheels (.whl/)" ensure_wheels
  for target in "${targets[@]}"; do
    timed "build $name:$target" build_one "$target"
  done
}

# Runs deploy/docker/image-test-TARGET.sh inside the image, as the image's user.
test_one() {  # target
  local target="$1" ctr rc=0
  ctr=$(buildah from "$name:$target")
  buildah run --isolation chroot -v "$repo/deploy/docker:/image-test:ro" "$ctr" -- \
    bash "/image-test/image-test-$target.sh" || rc=$?
  buildah rm "$ctr" >/dev/null
  return $rc
}

summary() {
  echo
  echo "image: timings"
  printf '  %s\n' "${timings[@]}"
  echo "image: sizes"
  for target in "${targets[@]}"; do
    printf '  %-40s %s\n' "$name:$target" "$(image_size "$name:$target")"
  done
  [[ "$base" == localhost/* ]] && printf '  %-40s %s\n' "$base" "$(image_size "$base")"
  return 0
}

case "$action" in
  build)
    build_all
    summary
    ;;
  test)
    missing=0
    for target in "${targets[@]}"; do
      buildah inspect --type image "$name:$target" >/dev/null 2>&1 || missing=1
    done
    if [[ "${IMAGE_REBUILD:-0}" == 1 || $missing == 1 ]]; then
      build_all
    else
      log "reusing ${targets[*]} images (IMAGE_REBUILD=1 rebuilds)"
    fi
    failed=()
    for target in "${targets[@]}"; do
      timed "test $name:$target" test_one "$target" || failed+=("$target")
    done
    summary
    if [[ ${#failed[@]} -gt 0 ]]; then
      echo "image: FAILED: ${failed[*]}" >&2
      exit 1
    fi
    echo "image: all image tests passed (${targets[*]})"
    ;;
  *) echo "usage: $0 build|test [cpu|gpu|all]" >&2; exit 2 ;;
esac
