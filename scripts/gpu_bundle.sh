#!/usr/bin/env bash
# make gpu-bundle: what `make gpu-check` needs on a GPU machine that reaches no package registry,
# built here. Copies a CUDA build's binaries, the test binaries with GPU cases, the fused-kernel
# benchmark (bench/fused_ops_bench), the control-plane benchmark (bench/control_plane_bench: GPU
# machines have more cores than the 2 this project's other machines offer it) and the shared
# libraries they load that such a machine lacks (gRPC, protobuf, Abseil, prometheus-cpp,
# yaml-cpp, SQLite, xxHash...: the Debian packages of scripts/bootstrap.sh) into one directory.
# Torch and its CUDA libraries are not copied: the GPU machine's own torch 2.11 provides them
# (scripts/gpu_check.py puts its lib/ and the nvidia-* wheels' on the library path).
#
#   scripts/gpu_bundle.sh BUILD_DIR BUNDLE_DIR
#
# Also writes BUNDLE_DIR.tgz, the same in one archive. Then, on the GPU machine, in a copy of the
# same tree at the same path (the test binaries find the corpus and examples there), with either:
# make gpu-check GPU_BUNDLE=BUNDLE_DIR
set -euo pipefail
build_dir="${1:?usage: gpu_bundle.sh BUILD_DIR BUNDLE_DIR}"
bundle="${2:?usage: gpu_bundle.sh BUILD_DIR BUNDLE_DIR}"
root="$(cd "$(dirname "$0")/.." && pwd)"

if ! grep -q '^TESSERA_CUDA_ENABLED:INTERNAL=ON' "$build_dir/CMakeCache.txt" 2>/dev/null; then
  echo "gpu-bundle: $build_dir is not a CUDA build (configure with WITH_CUDA=ON and a CUDA" \
    "torch; the CUDA toolkit is enough, no GPU is needed)" >&2
  exit 1
fi
# The GPU test binaries, as scripts/gpu_check.py's GPU_TESTS lists them.
tests=$(python3 - "$root/scripts/gpu_check.py" <<'PY'
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
for node in tree.body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "GPU_TESTS":
        print(" ".join(binary for binary, _ in ast.literal_eval(node.value)))
PY
)
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/tests" "$bundle/lib" "$bundle/bench"
cp "$build_dir"/bin/tessera "$build_dir"/bin/tessera-{coordinator,worker,trainer} "$bundle/bin/"
cp "$build_dir"/bench/fused_ops_bench "$build_dir"/bench/control_plane_bench "$bundle/bench/"
for t in $tests; do cp "$build_dir/tests/$t" "$bundle/tests/"; done

# Libraries every Linux has (glibc, the GCC runtime, zlib, OpenSSL: the GPU machine's own are
# newer and its python loads them too), the driver's, and torch's (found there) stay behind, and
# so does the CUDA runtime the fused kernels link (trainer/kernels/CMakeLists.txt): the one of torch's CUDA
# wheels serves both there.
skip='/(libc|libm|libdl|librt|libpthread|libutil|libresolv|ld-linux[^/]*|libstdc\+\+|libgcc_s|libz|libssl|libcrypto|libcuda|libcudart|libnvidia[^/]*)\.so'
for binary in "$bundle"/bin/* "$bundle"/tests/* "$bundle"/bench/*; do
  ldd "$binary" | awk '/=>/ && $3 ~ /^\// {print $3}'
done | sort -u | grep -vE "$skip" | grep -v '/site-packages/' | while read -r lib; do
  cp -L "$lib" "$bundle/lib/"
done

commit="$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
[[ -z "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ]] || commit+="-dirty"
cat > "$bundle/BUNDLE" <<EOF
Tessera GPU bundle (scripts/gpu_bundle.sh)
commit: $commit
built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), $(. /etc/os-release && echo "$PRETTY_NAME")
source: $root
torch: $(grep -m1 '^Torch_DIR:' "$build_dir/CMakeCache.txt" | cut -d= -f2-)
EOF
# The same as one gzip archive beside it (about a third of the size: what to copy when the copy's
# size is limited); `make gpu-check` unpacks it when the directory is not there.
tar -czf "$bundle.tgz" -C "$(dirname "$bundle")" "$(basename "$bundle")"
echo "gpu-bundle: $(du -sh "$bundle" | cut -f1) in $bundle ($(ls "$bundle/lib" | wc -l) libraries)," \
  "$(du -sh "$bundle.tgz" | cut -f1) as $bundle.tgz; on the GPU machine: make gpu-check GPU_BUNDLE=$bundle"
