#!/usr/bin/env bash
# Runs Tessera's fuzz targets (tests/fuzz) for a while each; `make fuzz` calls it.
#
#   tests/fuzz/run_fuzzers.sh <build dir> <seconds per target> [target...]
#
# No target named: every <build dir>/*_fuzz. Each starts from its seeds (tests/fuzz/corpus/<name>)
# and what earlier runs found (<build dir>/corpus/<name>, where new inputs go). A crash, timeout,
# leak or out-of-memory input lands in <build dir>/artifacts/<name>/; the run goes on with the
# next target, ends with the list of what was found, and exits 1 if anything was.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 <build dir> <seconds per target> [target...]" >&2
  exit 2
fi
build=$1
seconds=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
# Sanitizer reports with files and lines (Debian names the tool with its version).
if [[ -z "${ASAN_SYMBOLIZER_PATH:-}" ]] && command -v llvm-symbolizer-14 >/dev/null; then
  export ASAN_SYMBOLIZER_PATH=$(command -v llvm-symbolizer-14)
fi

targets=("$@")
if [[ ${#targets[@]} == 0 ]]; then
  for bin in "$build"/*_fuzz; do
    [[ -x "$bin" ]] && targets+=("$(basename "$bin" _fuzz)")
  done
fi
if [[ ${#targets[@]} == 0 ]]; then
  echo "run_fuzzers: no fuzz targets in $build" >&2
  exit 2
fi

stamp=$(mktemp)
trap 'rm -f "$stamp"' EXIT
failed=()
for name in "${targets[@]}"; do
  bin="$build/${name}_fuzz"
  if [[ ! -x "$bin" ]]; then
    echo "run_fuzzers: no target $bin" >&2
    exit 2
  fi
  mkdir -p "$build/corpus/$name" "$build/artifacts/$name"
  log="$build/artifacts/$name/last-run.log"
  echo "fuzz: $name for ${seconds}s"
  if "$bin" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$build/artifacts/$name/" \
      "$build/corpus/$name" "$here/corpus/$name" >"$log" 2>&1; then
    grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true
  else
    failed+=("$name")
    echo "fuzz: $name FAILED; its log: $log"
    grep -E 'ERROR:|SUMMARY:|contract broken|runtime error|Test unit written' "$log" | head -8 || true
  fi
done

if [[ ${#failed[@]} == 0 ]]; then
  echo "fuzz: ${#targets[@]} targets ran ${seconds}s each, nothing found"
  exit 0
fi
echo
echo "fuzz: found something in: ${failed[*]}. The inputs:"
find "$build/artifacts" -type f -newer "$stamp" \
  \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) -print
echo "Replay one with <build dir>/<name>_fuzz <input>. Once fixed, check the input in as"
echo "tests/fuzz/regressions/<name>/<what-it-was>: make test replays every file there."
exit 1
