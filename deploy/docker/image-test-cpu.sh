#!/usr/bin/env bash
# Runs inside the CPU image (scripts/image.sh test cpu), as the image's user: every binary's
# libraries resolve, the trainer's --check passes, and a coordinator, a worker and a 2-rank CPU
# job (image-test-job.yaml) run to SUCCEEDED with the binaries in the image. Then prints what
# the image's libraries are made of (libs.tsv, written by collect-libs.sh).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
fail() { echo "image-test-cpu: FAIL: $*" >&2; exit 1; }
step() { echo "image-test-cpu: $*"; }

[[ $(id -u) == 10001 ]] || fail "runs as uid $(id -u), not 10001"
for object in /usr/local/bin/tessera* /usr/local/lib/libtessera_sentencepiece.so; do
  listing=$(/lib64/ld-linux-x86-64.so.2 --list "$object" 2>&1) || fail "$object: $listing"
  ! grep 'not found' <<<"$listing" || fail "$object does not resolve"
done
for binary in /usr/local/bin/tessera*; do
  "$binary" --version >/dev/null || fail "$binary --version"
done
tessera-trainer --version
tessera-trainer --version | grep -q 'CUDA off' || fail "the trainer is not the CPU build"
# scripts/image.sh passes the checkout's commit (GIT_COMMIT): the binaries say which they are.
! tessera-trainer --version | grep -q 'commit unknown' || fail "the image's binaries report no commit"
corpus=/usr/local/share/tessera/corpus/kjv-genesis-ruth.txt
[[ -f "$corpus" ]] || fail "no bundled corpus at $corpus"

# The trainer dlmopen()s the SentencePiece shim from ../lib beside it: a file that is no model
# must get as far as SentencePiece's own parser.
echo "not a model" >/tmp/junk.model
spm=$(tessera-trainer prepare --input="$corpus" --output_dir=/tmp/spm --tokenizer=/tmp/junk.model \
        2>&1 || true)
if grep -q 'cannot load the SentencePiece library' <<<"$spm" || ! grep -qi 'junk.model' <<<"$spm"; then
  echo "$spm" >&2
  fail "the SentencePiece shim does not load"
fi
step "SentencePiece shim loads (a junk model is refused by SentencePiece: $(tail -n 1 <<<"$spm" | cut -c1-100))"

step "tessera-trainer --check"
start=$SECONDS
tessera-trainer --check || fail "tessera-trainer --check"
step "--check took $((SECONDS - start))s"

work=$(mktemp -d /tmp/image-test.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
wait_for_line() {  # file, pattern
  for _ in $(seq 300); do
    grep -q "$2" "$1" && return 0
    sleep 0.1
  done
  cat "$1" >&2
  fail "'$2' did not appear in $1"
}

start=$SECONDS
step "a coordinator, a worker (2 CPU slots) and a 2-rank job, in $work"
tessera-trainer prepare --input="$corpus" --output_dir="$work/data" >"$work/prepare.log" 2>&1 ||
  { cat "$work/prepare.log" >&2; fail "prepare"; }
# buildah's chroot isolation shares the host's network: a master port off the default 29500
# keeps clear of the host's own jobs and tests.
tessera-coordinator --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --master_port_base=$((20000 + RANDOM % 20000)) --state="$work/coordinator.db" --checkpoint_root="$work/checkpoints" 2>"$work/coordinator.log" &
pids+=($!)
wait_for_line "$work/coordinator.log" "serving gRPC on"
address=$(sed -n 's/.*serving gRPC on \([^,]*\).*/\1/p' "$work/coordinator.log")
tessera-worker --coordinator="$address" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --node_name=image-test --cpu_slots=2 --work_dir="$work/worker" 2>"$work/worker.log" &
pids+=($!)
wait_for_line "$work/worker.log" "registered with"
export TESSERA_DATA_DIR="$work/data"
if ! tessera --coordinator="$address" submit "$here/image-test-job.yaml" --watch; then
  tail -n 30 "$work/worker.log" >&2
  fail "the job did not succeed"
fi
job=$(tessera --coordinator="$address" list | awk 'NR==1 {print $1}')
tessera --coordinator="$address" status "$job"
for rank in 0 1; do
  lines=$(tessera --coordinator="$address" logs "$job" --rank=$rank --tail=2)
  [[ -n "$lines" ]] || fail "no log of rank $rank"
  echo "rank $rank: $lines"
done
tessera --coordinator="$address" checkpoints "$job"
step "the job took $((SECONDS - start))s"

# What the copied libraries are made of (MB), by origin.
echo
step "libraries in /usr/local/lib/tessera (collect-libs.sh's closure of the binaries)"
awk -F'\t' '
  $3 ~ /^base:/ { next }
  { if ($3 == "torch") group = "torch wheel: torch/lib"
    else if ($3 ~ /^nvidia\//) group = "nvidia wheels (CUDA runtime libtorch_cpu needs)"
    else group = "Debian packages"
    size[group] += $2; names[group] = names[group] " " $1 }
  END { for (g in size) printf "  %-50s %8.1f MB %s\n", g, size[g] / 1e6, names[g] }
' /usr/local/lib/tessera/libs.tsv | sort
printf '  %-50s %8.1f MB\n' "our binaries (/usr/local/bin/tessera*)" \
  "$(du -cb /usr/local/bin/tessera* | tail -n 1 | awk '{print $1 / 1e6}')"
printf '  %-50s %8.1f MB\n' "/usr/local/share/tessera" \
  "$(du -sb /usr/local/share/tessera | awk '{print $1 / 1e6}')"
step "already in the base image, not copied: $(awk -F'\t' '$3 ~ /^base:/ {printf "%s ", $1}' \
  /usr/local/lib/tessera/libs.tsv)"
step "passed"
