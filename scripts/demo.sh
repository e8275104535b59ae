#!/usr/bin/env bash
# make demo: the whole system on this machine. Starts a coordinator and a
# worker with two CPU slots on loopback, tokenizes the bundled corpus, submits
# examples/tiny-gpt.yaml (a small GPT-2, data parallel over two trainer
# processes on Gloo) and follows it to the end with the tessera CLI.
set -euo pipefail
build_dir="${1:-build}"
bin="$(cd "$build_dir/bin" && pwd)"
work=$(mktemp -d /tmp/tessera-demo.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

wait_for_line() {  # file, pattern
  for _ in $(seq 100); do
    grep -q "$2" "$1" && return 0
    sleep 0.1
  done
  echo "demo: '$2' did not appear in $1:" >&2
  cat "$1" >&2
  return 1
}

echo "demo: working in $work"
echo "demo: tokenizing the bundled corpus (data/corpus) into token shards"
"$bin/tessera-trainer" prepare --input=data/corpus/kjv-genesis-ruth.txt --output_dir="$work/data"

echo "demo: starting a coordinator and a worker (2 CPU slots) on 127.0.0.1"
"$bin/tessera-coordinator" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --state="$work/coordinator.db" --checkpoint_root="$work/checkpoints" \
  2>"$work/coordinator.log" &
pids+=($!)
wait_for_line "$work/coordinator.log" "serving gRPC on"
address=$(sed -n 's/.*serving gRPC on \([^,]*\).*/\1/p' "$work/coordinator.log")
"$bin/tessera-worker" --coordinator="$address" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --node_name=demo-node --cpu_slots=2 --work_dir="$work/worker" 2>"$work/worker.log" &
pids+=($!)
wait_for_line "$work/worker.log" "registered with"
tessera() { "$bin/tessera" --coordinator="$address" "$@"; }
tessera nodes

export TESSERA_DATA_DIR="$work/data"
echo "demo: TESSERA_DATA_DIR=$TESSERA_DATA_DIR tessera submit examples/tiny-gpt.yaml --watch"
tessera submit examples/tiny-gpt.yaml --watch | awk '!/step [0-9]+\// || /step [0-9]*0\//'
job=$(tessera list | awk 'NR==1 {print $1}')
echo "demo: checkpoints of $job"
tessera checkpoints "$job"
echo "demo: loss and throughput curves"
tessera plot "$job" -o "$work/$job.svg"
echo "demo: last lines of rank 1's log"
tessera logs "$job" --rank=1 --tail=3
tessera status "$job"
coordinator_metrics=$(sed -n 's/.*metrics on port \([0-9]*\).*/\1/p' "$work/coordinator.log")
worker_metrics=$(sed -n 's/.*metrics on port \([0-9]*\).*/\1/p' "$work/worker.log")
echo "demo: /metrics of the coordinator: http://127.0.0.1:$coordinator_metrics/metrics" \
  "and of the worker: http://127.0.0.1:$worker_metrics/metrics (until the demo exits)"
curl -s "http://127.0.0.1:$worker_metrics/metrics" 2>/dev/null | grep '^tessera_train_loss' || true
echo "demo: done. Logs and state are in $work"
