#!/usr/bin/env bash
# make bench: run every benchmark binary under build/bench/. Each prints its
# figures as ratios against a baseline measured in the same run.
set -euo pipefail
build_dir="${1:-build}"
shopt -s nullglob
benches=("$build_dir"/bench/*_bench)
if [[ ${#benches[@]} == 0 ]]; then
  echo "bench: no benchmarks are built yet (the benchmarks issue adds them)"
  exit 0
fi
for bench in "${benches[@]}"; do
  echo "== $(basename "$bench")"
  "$bench"
done
