#!/usr/bin/env bash
# make bench / make bench-gpu: runs the benchmarks under bench/ and collects
# their JSON results in $build_dir/bench/results/. Each benchmark compares
# against a baseline measured in the same run and prints the ratios.
#
#   scripts/bench.sh BUILD_DIR [cpu|gpu] [NAME...]
#
# Every benchmark receives, in the environment:
#   TESSERA_BENCH_RESULTS  directory for its NAME.json
#   TESSERA_BENCH_COMMIT   git commit of the tree (with "-dirty" when modified)
#   TESSERA_BENCH_DATE     UTC date and time of this run (ISO 8601)
#   TESSERA_BENCH_MACHINE  one line: CPU model, cores, memory, GPUs
#   TESSERA_BENCH_PYTHON   the Python with the pinned torch wheel
#   TESSERA_BUILD_DIR      the build directory (binaries in bin/ and bench/)
# and embeds the first four in its JSON so a result says where it came from.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build_dir="$(cd "${1:-build}" && pwd)"
mode="${2:-cpu}"
shift $(($# > 2 ? 2 : $#))
only=("$@")

commit="$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
if [[ -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
  commit+="-dirty"
fi
cpu_model="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
mem_gib="$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)"
gpus="none"
if command -v nvidia-smi > /dev/null 2>&1; then
  gpus="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c |
    awk '{c=$1; $1=""; printf "%s%dx%s", (n++ ? ", " : ""), c, $0}')" || gpus="none"
  [[ -n "$gpus" ]] || gpus="none"
fi
export TESSERA_BENCH_RESULTS="$build_dir/bench/results"
export TESSERA_BENCH_COMMIT="$commit"
export TESSERA_BENCH_DATE="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
export TESSERA_BENCH_MACHINE="$cpu_model, $(nproc) cores, ${mem_gib} GiB RAM, GPUs: $gpus"
export TESSERA_BENCH_PYTHON="$("$root/scripts/bootstrap.sh" --print-python)"
export TESSERA_BUILD_DIR="$build_dir"
mkdir -p "$TESSERA_BENCH_RESULTS"
echo "bench: $TESSERA_BENCH_MACHINE; commit $commit; results in $TESSERA_BENCH_RESULTS"

# name, command (run from the repository root), mode it belongs to.
benches=(
  "trainer|$TESSERA_BENCH_PYTHON bench/trainer_bench.py --device=cpu|cpu"
  "trainer-gpu|$TESSERA_BENCH_PYTHON bench/trainer_bench.py --device=cuda|gpu"
  "fused-ops|$build_dir/bench/fused_ops_bench|gpu"
  "fused-ops-cpu|$build_dir/bench/fused_ops_bench --cpu|cpu"
  "checkpoint|$build_dir/bench/checkpoint_bench|cpu"
  "step-metrics|$build_dir/bench/step_metrics_bench|cpu"
  "zero|$TESSERA_BENCH_PYTHON bench/zero_bench.py|cpu"
  "model-parallel|$TESSERA_BENCH_PYTHON bench/model_parallel_bench.py|cpu"
  "fault|$TESSERA_BENCH_PYTHON bench/fault_bench.py|cpu"
  "peermem|$TESSERA_BENCH_PYTHON bench/peermem_bench.py|cpu"
  "failover|$TESSERA_BENCH_PYTHON bench/failover_bench.py|cpu"
  "lora|$TESSERA_BENCH_PYTHON bench/lora_bench.py|cpu"
  "moe|$TESSERA_BENCH_PYTHON bench/moe_bench.py|cpu"
  "planner-fit|$TESSERA_BENCH_PYTHON bench/planner_fit_bench.py|cpu"
  "breakdown|$TESSERA_BENCH_PYTHON bench/breakdown_bench.py|cpu"
  "control-plane|$build_dir/bench/control_plane_bench --coordinator=$build_dir/bin/tessera-coordinator|cpu"
)
status=0
ran=0
for entry in "${benches[@]}"; do
  IFS='|' read -r name command bench_mode <<< "$entry"
  [[ "$bench_mode" == "$mode" ]] || continue
  if ((${#only[@]})) && [[ ! " ${only[*]} " == *" $name "* ]]; then continue; fi
  program="${command%% *}"
  script="$(echo "$command" | awk '{print $2}')"
  if [[ ! -x "$program" ]] || [[ "$script" == bench/*.py && ! -f "$root/$script" ]]; then
    echo "== $name: not built, skipped"
    continue
  fi
  echo "== $name"
  ran=$((ran + 1))
  (cd "$root" && eval "$command") || { echo "== $name FAILED"; status=1; }
done
echo "bench: $ran benchmark(s) run; JSON in $TESSERA_BENCH_RESULTS"
exit $status
