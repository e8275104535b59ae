#!/usr/bin/env bash
# Runs inside the GPU image (scripts/image.sh test gpu), as the image's user, with no GPU: the
# trainer is the CUDA build, and every binary and every shared library the trainer can load
# (torch/lib, the nvidia wheels' lib directories, NCCL and the verbs providers) resolves. Only
# the driver's libraries may be missing: the NVIDIA container runtime mounts them at run time.
set -euo pipefail
fail() { echo "image-test-gpu: FAIL: $*" >&2; exit 1; }
step() { echo "image-test-gpu: $*"; }
lib=/usr/local/lib/tessera
driver_libs=" libcuda.so.1 libnvidia-ml.so.1 "
# NVSHMEM's plugins for MPI, PMIx, OpenSHMEM, libfabric and UCX: loaded only when configured
# to, and their libraries are not in the image (the Dockerfile's OPTIONAL_PLUGINS).
optional='nvshmem_(bootstrap_(mpi|pmix|shmem)|transport_(libfabric|ucx))'

[[ $(id -u) == 10001 ]] || fail "runs as uid $(id -u), not 10001"
for dir in "$lib"/nvidia/*/lib; do
  [[ ":$LD_LIBRARY_PATH:" == *":$dir:"* ]] || fail "LD_LIBRARY_PATH lacks $dir"
done

objects=(/usr/local/bin/tessera* /usr/local/lib/libtessera_sentencepiece.so "$lib"/*.so* "$lib"/torch/lib/*.so* "$lib"/nvidia/*/lib/*.so*
         /usr/lib/x86_64-linux-gnu/libibverbs/*.so /usr/lib/x86_64-linux-gnu/libibverbs.so.1
         /usr/lib/x86_64-linux-gnu/librdmacm.so.1)
checked=0 skipped=0 bad=0
for object in "${objects[@]}"; do
  [[ -e "$object" ]] || fail "$object is missing"
  if grep -qE "$optional" <<<"$object"; then skipped=$((skipped + 1)); continue; fi
  listing=$(/lib64/ld-linux-x86-64.so.2 --list "$object" 2>&1 || true)
  while read -r soname; do
    [[ "$driver_libs" == *" $soname "* ]] && continue
    echo "image-test-gpu: $object: $soname not found" >&2
    bad=1
  done < <(awk '$2 == "=>" && $3 == "not" {print $1}' <<<"$listing")
  if grep -q 'error while loading' <<<"$listing" &&
     ! grep -qE 'error while loading shared libraries: (libcuda|libnvidia-ml)\.so\.1' <<<"$listing"; then
    echo "$listing" >&2
    bad=1
  fi
  checked=$((checked + 1))
done
[[ $bad == 0 ]] || fail "unresolved libraries (above)"
step "ld.so --list: $checked objects resolve (driver libraries aside), $skipped optional plugins skipped"

tessera-trainer --version
tessera-trainer --version | grep -q 'CUDA on' || fail "the trainer is not the CUDA build"
# scripts/image.sh passes the checkout's commit (GIT_COMMIT): the binaries say which they are.
! tessera-trainer --version | grep -q 'commit unknown' || fail "the image's binaries report no commit"
/lib64/ld-linux-x86-64.so.2 --list /usr/local/bin/tessera-trainer | grep -E 'libtorch_cuda|libnccl|libcudart'
for binary in tessera tessera-coordinator tessera-worker; do "$binary" --version >/dev/null; done
[[ -f /usr/local/share/tessera/corpus/kjv-genesis-ruth.txt ]] || fail "no bundled corpus"
step "passed"
