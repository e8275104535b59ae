#!/usr/bin/env bash
# Runs in the image's build stage: copies the shared libraries that OBJECTS load (as the dynamic
# linker resolves them, `ld.so --list`) into OUT/lib, flat, one file per soname, and writes
# OUT/libs.tsv (soname, bytes, origin) for the size table of docs/image.md.
#
#   collect-libs.sh all    OUT OBJECT...  every library, torch's and the nvidia wheels' included
#   collect-libs.sh debian OUT OBJECT...  only the Debian packages' libraries (the GPU image
#                                         carries the torch and nvidia wheel trees whole)
#
# Libraries of packages already in the runtime base image (the list the build stage wrote to
# /etc/tessera-base-packages before installing anything) are listed with origin "base" but not
# copied. A library that does not resolve fails the run, except the driver's (libcuda.so.1,
# libnvidia-ml.so.1), which the NVIDIA container runtime mounts at run time, and those named in
# RUNTIME_PROVIDED (sonames the runtime stage installs itself, e.g. rdma-core's).
set -euo pipefail
mode="$1" out="$2"
shift 2
base_packages=/etc/tessera-base-packages
provided=" libcuda.so.1 libnvidia-ml.so.1 ${RUNTIME_PROVIDED:-} "
mkdir -p "$out/lib"
: >"$out/libs.tsv.tmp"

# The Debian package that owns PATH (usrmerge: dpkg may know it under /lib or /usr/lib).
owner_of() {
  local path="$1" real
  real=$(readlink -f "$path")
  for candidate in "$path" "$real" "${path#/usr}" "/usr$path" "${real#/usr}" "/usr$real"; do
    dpkg -S "$candidate" 2>/dev/null | head -n 1 | cut -d: -f1 && return 0
  done
  return 1
}

declare -A seen=()
missing=0
for object in "$@"; do
  listing=$(/lib64/ld-linux-x86-64.so.2 --list "$object" 2>&1 || true)
  while read -r soname arrow path _; do
    [[ "$arrow" == "=>" ]] || continue
    if [[ "$path" == "not" ]]; then
      if [[ "$provided" != *" $soname "* ]]; then
        echo "collect-libs: $object: $soname not found" >&2
        missing=1
      fi
      continue
    fi
    [[ -n "${seen[$soname]:-}" ]] && continue
    seen[$soname]=1
    # Through libtorch's RPATH a path reads torch/lib/../../nvidia/...: classify the real one,
    # nvidia first (the build's venv is /opt/torch/lib/python3.*/...).
    real=$(readlink -f "$path")
    case "$real" in
      */nvidia/*/lib/*) origin="nvidia/$(echo "$real" | sed 's|.*/nvidia/\([^/]*\)/lib/.*|\1|')" ;;
      */torch/lib/*) origin="torch" ;;
      *) origin=$(owner_of "$path") || { echo "collect-libs: no package owns $path" >&2; exit 1; } ;;
    esac
    bytes=$(stat -L -c %s "$path")
    if grep -qx "${origin%%:*}" "$base_packages"; then
      printf '%s\t%s\t%s\n' "$soname" "$bytes" "base:$origin" >>"$out/libs.tsv.tmp"
      continue
    fi
    case "$origin" in torch | nvidia/*) [[ "$mode" == debian ]] && continue ;; esac
    cp -L "$path" "$out/lib/$soname"
    printf '%s\t%s\t%s\n' "$soname" "$bytes" "$origin" >>"$out/libs.tsv.tmp"
  done <<<"$listing"
done
[[ $missing == 0 ]] || exit 1
sort -t $'\t' -k3,3 -k1,1 "$out/libs.tsv.tmp" >"$out/libs.tsv"
rm -f "$out/libs.tsv.tmp"
