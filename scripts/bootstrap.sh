#!/usr/bin/env bash
# Installs everything Tessera needs to build and test, and nothing that is
# already there. Idempotent: a second run only checks, and takes seconds.
#
#   scripts/bootstrap.sh                 install what is missing
#   scripts/bootstrap.sh --print-python  install, then print the python that holds torch
#   scripts/bootstrap.sh --image-tools   only the image tools (buildah, debootstrap) that
#                                        scripts/image.sh needs; opt-in, never by default
#
# Environment:
#   TESSERA_CACHE_DIR   shared cache for the LibTorch venv (default ~/.cache/tessera);
#                       every clone on the machine reuses it.
#   TESSERA_PYTHON      a python interpreter that already holds torch; skips the venv.
#   TESSERA_SKIP_APT=1  never call apt-get (machines without a package registry).
set -euo pipefail

# The LibTorch release Tessera builds against. The GPU machines carry this
# release in their system python3, so one source tree builds in both places.
readonly TORCH_VERSION="2.11.0"
readonly TORCH_SERIES="2.11."
# Installed next to torch in its venv for tests/hf_interop_test.py and tests/lora_peft_test.py
# (which skip without them), and for `prepare` with a Hugging Face tokenizer.json (tokenizers
# comes with transformers).
readonly TRANSFORMERS_PIN="transformers==4.57.1"
readonly PEFT_PIN="peft==0.17.1"
# tests/tensorboard_test.py reads the trainer's event files with tensorboard's own reader.
readonly TENSORBOARD_PIN="tensorboard==2.20.0"

# The Debian packages: deploy/packages/build (what builds the binaries; the Dockerfile reads the
# same list) and deploy/packages/test (what only the tests use). One name a word; '#' comments.
read_package_list() {
  sed -e 's/#.*//' "$1" | tr -s ' \t' '\n' | sed '/^$/d'
}
packages_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../deploy/packages" && pwd)"
mapfile -t APT_PACKAGES < <(read_package_list "$packages_dir/build"; read_package_list "$packages_dir/test")
readonly APT_PACKAGES

# Deploy tools for the chart's tests (a Helm renderer and Kubernetes' OpenAPI schemas), pinned;
# in a venv of their own so that torch's stays as it is.
readonly TOOLS_PACKAGES=(
  "helm-python-sdk==0.2.2"      # Helm v4 as a library: renders charts offline
  "kubernetes-validate==1.37.0" # Kubernetes OpenAPI schemas, 1.30 to 1.37, strict mode
  "PyYAML==6.0.2"
  "jsonschema==4.23.0"
)
readonly TOOLS_TAG="tools-1"

# Opt-in (--image-tools): what scripts/image.sh (make image, make image-test) needs to build and
# run the container images without a container daemon or registry: buildah builds a Dockerfile
# and runs in the image (--isolation chroot), debootstrap makes the Debian base image.
readonly IMAGE_TOOLS_PACKAGES=(buildah debootstrap)

print_python=0
print_tools_python=0
[[ "${1:-}" == "--print-python" ]] && print_python=1
[[ "${1:-}" == "--print-tools-python" ]] && print_tools_python=1

# Progress goes to stderr: stdout carries only the --print-python answer.
log() { echo "bootstrap: $*" >&2; }

as_root() {
  if [[ $(id -u) == 0 ]]; then "$@"; else sudo "$@"; fi
}

# Installs the packages named (APT_PACKAGES when none are) that are missing.
install_apt_packages() {
  local wanted=("$@") missing=()
  [[ $# == 0 ]] && wanted=("${APT_PACKAGES[@]}")
  for pkg in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
  done
  [[ ${#missing[@]} == 0 ]] && return 0
  if [[ "${TESSERA_SKIP_APT:-0}" == 1 ]]; then
    log "missing Debian packages (TESSERA_SKIP_APT=1, not installing): ${missing[*]}"
    return 0
  fi
  log "installing Debian packages: ${missing[*]}"
  as_root apt-get update -q >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}" >&2
}

# Prints the version of torch that python "$1" holds, without importing torch
# (importing it takes seconds; reading its metadata takes milliseconds).
torch_version_of() {
  "$1" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
try:
    print(m.version("torch"))
except m.PackageNotFoundError:
    pass
PY
}

find_or_install_torch() {
  if [[ -n "${TESSERA_PYTHON:-}" ]]; then
    echo "$TESSERA_PYTHON"; return 0
  fi
  # A machine whose python3 already has the pinned series (the GPU machines) uses it.
  if command -v python3 >/dev/null; then
    local system_version
    system_version=$(torch_version_of python3)
    if [[ "$system_version" == ${TORCH_SERIES}* ]]; then
      command -v python3; return 0
    fi
  fi
  local cache_dir="${TESSERA_CACHE_DIR:-$HOME/.cache/tessera}"
  local venv="$cache_dir/torch-$TORCH_VERSION"
  mkdir -p "$cache_dir"
  (
    # Clones on one machine share the venv; the lock keeps two first runs apart.
    flock 9
    if [[ "$(torch_version_of "$venv/bin/python")" != ${TORCH_SERIES}* ]]; then
      log "installing torch==$TORCH_VERSION from PyPI into $venv (once per machine)"
      rm -rf "$venv"
      python3 -m venv "$venv" >&2
      "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir \
        "torch==$TORCH_VERSION" numpy >&2
    fi
    # Once per pin, also into a venv made before it; never touches torch (a failure only logs:
    # the test that needs it skips).
    for pin in "$TRANSFORMERS_PIN" "$PEFT_PIN" "$TENSORBOARD_PIN"; do
      if [[ ! -f "$venv/.$pin" ]]; then
        log "installing $pin into $venv (once)"
        "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir "$pin" >&2 &&
          touch "$venv/.$pin" || log "$pin not installed; the tests that need it will skip"
      fi
    done
  ) 9>"$cache_dir/.lock"
  echo "$venv/bin/python"
}

# Prints the tools venv's python, creating it once per machine; prints nothing when it cannot be
# made (no registry): the chart tests then skip.
find_or_install_tools() {
  local cache_dir="${TESSERA_CACHE_DIR:-$HOME/.cache/tessera}"
  local venv="$cache_dir/$TOOLS_TAG"
  mkdir -p "$cache_dir"
  (
    flock 9
    if [[ ! -f "$venv/.complete" ]]; then
      log "installing the deploy tools into $venv (once per machine)"
      rm -rf "$venv"
      python3 -m venv "$venv" >&2 &&
        "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir \
          "${TOOLS_PACKAGES[@]}" >&2 &&
        touch "$venv/.complete" || log "deploy tools not installed; the chart tests will skip"
    fi
  ) 9>"$cache_dir/.tools-lock"
  [[ -f "$venv/.complete" ]] && echo "$venv/bin/python"
  return 0
}

if [[ "${1:-}" == "--image-tools" ]]; then
  install_apt_packages "${IMAGE_TOOLS_PACKAGES[@]}"
  exit 0
fi
install_apt_packages
if [[ $print_tools_python == 1 ]]; then
  find_or_install_tools
  exit 0
fi
python=$(find_or_install_torch)
if [[ $print_python == 1 ]]; then
  echo "$python"
else
  log "ready (torch $(torch_version_of "$python") in $python)"
fi
