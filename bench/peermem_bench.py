#!/usr/bin/env python3
"""Recovery from peers' memory vs from storage on CPU: how long a restarted attempt takes to load
its checkpoint, and to train again, when the checkpoint comes from the workers' memory
(worker/shard_cache.h) and when it is read from the checkpoint directory.

    python bench/peermem_bench.py          # make bench BENCH=peermem

How it runs:
  1. `tessera-trainer prepare` tokenizes data/corpus/kjv-genesis-ruth.txt into byte-level shards.
  2. Per run and mode, a fresh real coordinator (heartbeats every 500 ms) and one real worker with
     two CPU slots on 127.0.0.1, driven through the `tessera` CLI. Mode "memory": the worker keeps
     shards in memory (its default cap, a quarter of RAM); mode "storage": --shard_cache_bytes=0.
  3. The job: data-parallel PRESET (default gpt2-124m, whose AdamW checkpoint is about 1.5 GB) on
     the two slots, global batch 2, seq_len 64, fp32, a checkpoint every 2 steps.
  4. Once the checkpoint of step 2 is committed, rank 1 gets SIGKILL. Then every file of the
     job's checkpoint directory is evicted from the page cache (posix_fadvise DONTNEED; the
     sandbox refuses /proc/sys/vm/drop_caches even to root), so a read from storage goes to the
     disk, as it would on a node that did not write the checkpoint or on shared storage.
  5. Measured: the restore time each rank of the next attempt reports (TrainerStarted.restore,
     from its log line "resumed from ... (from memory|storage, S s"; the slower rank counts), and
     from the kill until rank 0 of the next attempt logs its first step (its log polled every
     50 ms); and what saving the step-2 checkpoint took (its Checkpoint.write_seconds: in mode
     memory that includes handing each shard to the worker).
Runs alternate the modes; medians over RUNS runs each, and memory's median over storage's.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/peermem.json. Only the standard library.
"""

import argparse
import os
import re
import signal
import sys
import tempfile
import time

from bench_common import (RESULTS_ENV, BenchError, find_trainer, in_workdir, prepare_corpus,
                          provenance, rank_pid, restart_cluster, spread, write_job_spec,
                          write_results)

BENCH = "peermem"
CHECKPOINT_INTERVAL = 2
MAX_STEPS = 6
JOB_TIMEOUT_SECONDS = 900
POLL_SECONDS = 0.05


def write_spec(path, shards, preset):
    write_job_spec(path, "peermem", {"preset": preset}, shards, 64, 2, 1, 3e-4, 2, MAX_STEPS,
                   CHECKPOINT_INTERVAL, 2, 3)


def evict(directory):
    """Drops the page cache of every file under `directory`; the bytes evicted."""
    evicted = 0
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                evicted += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return evicted


STEP_LINE = re.compile(r"^\[rank 0\] step \d+:", re.MULTILINE)


def first_step_logged(workdir, job_id):
    """Whether rank 0 of attempt 1 has logged a step after resuming."""
    log = f"{workdir}/worker/jobs/{job_id}/attempt-1/rank-0.log"
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return False
    resumed = text.find("resumed from")
    return resumed >= 0 and STEP_LINE.search(text, resumed) is not None


RESUMED = re.compile(r"resumed from \S+ at step (\d+) \(from (memory|storage), ([\d.]+) s")


# A restore from memory's phases, as the rank logs them after its restore time.
PHASES = re.compile(r"fetch ([\d.]+) s, of which digests ([\d.]+) s over all shards, "
                    r"load ([\d.]+) s")


def restore_figures(workdir, job_id, attempt, world):
    """(source, slowest rank's restore seconds, checkpoint step, that rank's phases: a dict of
    fetch, digest and load seconds, empty when not logged) from the ranks' logs."""
    sources, seconds, steps, phases = set(), [], set(), []
    for rank in range(world):
        log = f"{workdir}/worker/jobs/{job_id}/attempt-{attempt}/rank-{rank}.log"
        with open(log, errors="replace") as f:
            text = f.read()
        match = RESUMED.search(text)
        if match is None:
            raise BenchError(f"{log}: no 'resumed from' line")
        steps.add(int(match.group(1)))
        sources.add(match.group(2))
        seconds.append(float(match.group(3)))
        phase = PHASES.search(text, match.end())
        phases.append({} if phase is None else {
            "fetch_seconds": float(phase.group(1)), "digest_seconds": float(phase.group(2)),
            "load_seconds": float(phase.group(3))})
    if len(sources) != 1 or len(steps) != 1:
        raise BenchError(f"ranks disagree: sources {sources}, steps {steps}")
    slowest = seconds.index(max(seconds))
    return sources.pop(), max(seconds), steps.pop(), phases[slowest]


def one_run(build_dir, workdir, shards, mode, preset, run):
    run_dir = os.path.join(workdir, f"{mode}-{run}")
    os.makedirs(run_dir)
    cluster = restart_cluster(build_dir, run_dir, worker_flags=(
        ("--shard_cache_bytes=0",) if mode == "storage" else ()))
    try:
        spec_path = os.path.join(run_dir, "job.yaml")
        write_spec(spec_path, shards, preset)
        job_id = cluster.cli("submit", spec_path).strip()
        start = time.monotonic()
        killed, kill_step, evicted, write_seconds = None, None, 0, None
        while True:
            if time.monotonic() - start > JOB_TIMEOUT_SECONDS:
                raise BenchError(f"{job_id} did not finish in {JOB_TIMEOUT_SECONDS} s")
            job = cluster.get(job_id)
            state, step = job["state"], job["current_step"]
            if state in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED"):
                raise BenchError(f"{job_id} {state}: {job.get('reason')}")
            if killed is None:
                checkpoint = int(job.get("latest_checkpoint", {}).get("step", 0))
                if state == "JOB_STATE_RUNNING" and checkpoint >= CHECKPOINT_INTERVAL:
                    pid = rank_pid(run_dir, job_id, 0, 1)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        killed, kill_step = time.monotonic(), step
                        write_seconds = float(job["latest_checkpoint"].get("write_seconds", 0))
                        evicted = evict(os.path.join(run_dir, "ckpt", job_id))
            elif first_step_logged(run_dir, job_id):
                first_step = time.monotonic() - killed
                break
            if state == "JOB_STATE_SUCCEEDED":
                raise BenchError(f"{job_id} succeeded before the restart was timed")
            time.sleep(POLL_SECONDS)
        source, restore_seconds, resumed_step, phases = restore_figures(run_dir, job_id, 1, 2)
        if source != mode:
            raise BenchError(f"{mode} run restored from {source}")
        cluster.cli("cancel", job_id, "--reason=benchmark done")
        checkpoint_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in
                               os.walk(os.path.join(run_dir, "ckpt", job_id, "step-" +
                                                    f"{resumed_step:08d}")) for f in fs)
        return {"mode": mode, "restore_seconds": restore_seconds,
                "kill_to_first_step_seconds": first_step, "kill_step": kill_step,
                "checkpoint_write_seconds": write_seconds,
                "resumed_step": resumed_step, "evicted_bytes": evicted,
                "checkpoint_bytes": checkpoint_bytes, "restore_phases": phases}
    finally:
        cluster.stop()


def measure(build_dir, trainer, workdir, args):
    shards = prepare_corpus(trainer, workdir, timeout=300)
    runs = []
    for run in range(args.runs):
        for mode in ("memory", "storage"):
            figures = one_run(build_dir, workdir, shards, mode, args.preset, run)
            print(f"  run {run + 1} {mode}: restore {figures['restore_seconds']:.2f} s, kill -> "
                  f"first step {figures['kill_to_first_step_seconds']:.2f} s "
                  f"({figures['checkpoint_bytes'] / 2**30:.2f} GiB checkpoint, written in "
                  f"{figures['checkpoint_write_seconds']:.2f} s)" +
                  ("; slower rank: fetch {fetch_seconds:.2f} s (digests {digest_seconds:.2f} s), "
                   "load {load_seconds:.2f} s".format(**figures["restore_phases"])
                   if figures["restore_phases"] else ""))
            runs.append(figures)
    by_mode = {}
    for mode in ("memory", "storage"):
        mine = [r for r in runs if r["mode"] == mode]
        by_mode[mode] = {
            "restore_seconds": spread([r["restore_seconds"] for r in mine]),
            "kill_to_first_step_seconds": spread([r["kill_to_first_step_seconds"] for r in mine]),
            "checkpoint_write_seconds": spread([r["checkpoint_write_seconds"] for r in mine]),
        }
    ratios = {}
    if runs:
        for figure in ("restore_seconds", "kill_to_first_step_seconds", "checkpoint_write_seconds"):
            ratios[figure] = (by_mode["memory"][figure]["median"] /
                              by_mode["storage"][figure]["median"])
    return {"modes": by_mode, "memory_over_storage": ratios, "runs": runs,
            "checkpoint_bytes": runs[0]["checkpoint_bytes"] if runs else 0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per mode")
    parser.add_argument("--preset", default="gpt2-124m", help="model preset of the job")
    parser.add_argument("--keep_workdir", action="store_true")
    args = parser.parse_args()
    found = find_trainer(BENCH)
    if found is None:
        return 1
    build_dir, trainer = found
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="tessera-peermem-bench-")
    figures = in_workdir(BENCH, workdir, args.keep_workdir,
                         lambda: measure(build_dir, trainer, workdir, args))
    if figures is None:
        return 1
    for mode, m in figures["modes"].items():
        print(f"{BENCH}: {mode}: restore median {m['restore_seconds']['median']:.2f} s, kill -> "
              f"first step median {m['kill_to_first_step_seconds']['median']:.2f} s, checkpoint "
              f"write median {m['checkpoint_write_seconds']['median']:.2f} s")
    for figure, ratio in figures["memory_over_storage"].items():
        print(f"{BENCH}: memory / storage, {figure}: {ratio:.2f}x")
    results = {
        "benchmark": BENCH,
        "method": __doc__,
        "config": {"preset": args.preset, "runs": args.runs,
                   "checkpoint_interval": CHECKPOINT_INTERVAL, "max_steps": MAX_STEPS},
        **figures,
        **provenance(trainer, trainer),
        "wall_seconds": time.monotonic() - started,
    }
    write_results(results, os.environ.get(RESULTS_ENV, os.path.join(build_dir, "bench", "results")),
                  f"{BENCH}.json", BENCH)
    return 0


if __name__ == "__main__":
    sys.exit(main())
