#!/usr/bin/env python3
"""Fault-tolerance benchmark on CPU: how long a job takes to get going again after one of its
ranks is killed, and how much of a job's wall time a failure every 100 steps costs (goodput).

    python bench/fault_bench.py          # make bench BENCH=fault

How it runs:
  1. `tessera-trainer prepare` tokenizes data/corpus/kjv-genesis-ruth.txt into byte-level shards.
  2. A real coordinator (heartbeat interval 500 ms, timeout 5 s) and one real worker with two CPU
     slots (stop grace 2 s) on 127.0.0.1, each in a fresh work directory; jobs go in and come out
     through the `tessera` CLI (submit, get --output=json), as a user's would.
  3. Every job is the same data-parallel tiny-gpt2 over the two slots (global batch 8, micro-batch
     2, seq_len 64, fp32, one intra-op thread per rank), checkpointing every CHECKPOINT_INTERVAL
     steps, max_restarts high enough never to run out.
  4. Recovery: one job of RECOVERY_KILLS x KILL_EVERY + 50 steps; whenever it has trained
     KILL_EVERY steps past where its attempt started, rank 1's trainer gets SIGKILL (found by its
     task file). Measured per kill, from the kill: until the job is RESTARTING (detected, the
     failure blamed), until it is RUNNING again (the old gang stopped, the new one placed, started
     and joined), and until the coordinator has the first step of the new attempt (the restart's
     whole cost, the checkpoint load included). The CLI's polling (about every 30 ms) bounds the
     resolution.
  5. Goodput: a GOODPUT_STEPS-step job run through without failure, and the same job with rank 1
     killed every KILL_EVERY steps. Goodput = the clean run's wall time (submission to SUCCEEDED)
     / the faulted run's. The difference per failure is the recovery above plus the steps retrained
     since the last checkpoint. It is shown as measured (tiny steps of a few tens of
     milliseconds, where recovery dominates) and projected onto longer steps:
     goodput(T) = GOODPUT_STEPS * T / (GOODPUT_STEPS * T + failures * (recovery + lost * T)), with
     lost = CHECKPOINT_INTERVAL / 2 steps retrained on average.

With --step_seconds S (e.g. 1): the goodput of a job whose steps take about S seconds, measured,
not projected (make bench BENCH=fault ARGS="--step_seconds 1 --runs 1"). The model is a wider
GPT-2 (LONG_STEP_DIMS, byte-level, seq_len 256) whose global batch is sized from a short
calibration job so that a step takes about S s on this machine (real compute, no sleeps); it
checkpoints every --checkpoint_interval steps (asynchronous saves: the step only waits for the
host copy). No separate recovery job: the faulted run's kills are timed, and its lost time is
split into detection (kill -> RESTARTING), restart (-> RUNNING), the first step of the new attempt
(process start, checkpoint load, rendezvous) and the steps retrained since the last checkpoint.
A failure's cost is the time from the kill until the new attempt is back at the killed step (its
first step, then the other retrained steps at the run's median step time); goodput = 1 - the
failures' cost / the faulted run's wall time, which needs no clean run (on a shared machine a
clean run and a faulted one see different loads; with --faulted_only none is run, otherwise the
clean / faulted wall ratio is recorded too). Results go to fault-step<S>s.json.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/fault.json with medians, ranges, every
kill's figures, the configuration, machine, date and commit. Only the standard library is used.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

from bench_common import (RESULTS_ENV, BenchError, find_trainer, in_workdir, prepare_corpus,
                          provenance, rank_pid, restart_cluster, spread, write_job_spec,
                          write_results)

BENCH = "fault"
CHECKPOINT_INTERVAL = 10
KILL_EVERY = 100
RECOVERY_KILLS = 5
GOODPUT_STEPS = 400
# Projected step times (seconds) for the goodput model.
PROJECTED_STEP_SECONDS = (0.1, 1.0, 5.0)
JOB_TIMEOUT_SECONDS = 900
POLL_SECONDS = 0.02


# The --step_seconds model: GPT-2 blocks wide enough that compute, not per-step overheads, sets
# the step time; byte-level like tiny-gpt2 so that the bundled corpus feeds it.
LONG_STEP_DIMS = {"architecture": "ARCHITECTURE_GPT2", "num_layers": 4, "hidden_size": 128,
                  "num_attention_heads": 4, "vocab_size": 257, "max_seq_len": 256,
                  "tie_embeddings": True}
LONG_STEP_SEQ_LEN = 256
LONG_STEP_MICRO_BATCH = 4
# Global batch of the calibration job: one micro-batch per rank.
CALIBRATION_BATCH = 2 * LONG_STEP_MICRO_BATCH
CALIBRATION_STEPS = 8


def write_spec(path, name, shards, steps, long_step_batch=0, interval=CHECKPOINT_INTERVAL):
    """A tiny-gpt2 spec, or with `long_step_batch` > 0 the --step_seconds model at that global
    batch."""
    if long_step_batch:
        write_job_spec(path, name, {"dims": LONG_STEP_DIMS}, shards, LONG_STEP_SEQ_LEN,
                       long_step_batch, LONG_STEP_MICRO_BATCH, 3e-3, 10, steps, interval, 2, 1000)
    else:
        write_job_spec(path, name, {"preset": "tiny-gpt2"}, shards, 64, 8, 2, 3e-3, 10, steps,
                       interval, 2, 1000)


def run_job(cluster, spec_path, kill_every, on_kill=None):
    """Submits the spec and follows it to SUCCEEDED, killing rank 1 whenever the running attempt
    has trained `kill_every` steps past its start (0: never). Returns (wall seconds, kills), each
    kill a dict of seconds from the kill to RESTARTING, to RUNNING and to the first new step."""
    job_id = cluster.cli("submit", spec_path).strip()
    start = time.monotonic()
    kills = []
    attempt_start = 0
    pending = None  # the kill being timed
    while True:
        if time.monotonic() - start > JOB_TIMEOUT_SECONDS:
            raise BenchError(f"{job_id} did not finish in {JOB_TIMEOUT_SECONDS} s")
        job = cluster.get(job_id)
        state, step, now = job["state"], job["current_step"], time.monotonic()
        if state == "JOB_STATE_FAILED":
            raise BenchError(f"{job_id} failed: {job.get('reason')}")
        if state == "JOB_STATE_SUCCEEDED":
            return now - start, kills, job
        if pending is not None:
            if "restarting" not in pending and job["restarts"] > pending["restarts_before"]:
                pending["restarting"] = now - pending["time"]
                pending["resume_step"] = step
            if "restarting" in pending and state == "JOB_STATE_RUNNING" and "running" not in pending:
                pending["running"] = now - pending["time"]
            if "running" in pending and step > pending["resume_step"]:
                pending["first_step"] = now - pending["time"]
                attempt_start = pending["resume_step"]
                kills.append({k: v for k, v in pending.items() if k != "time"})
                pending = None
        elif kill_every and state == "JOB_STATE_RUNNING" and step >= attempt_start + kill_every \
                and step < int(job["spec"]["max_steps"]) - 5:
            pid = rank_pid(cluster.workdir, job_id, int(job.get("attempt", 0)), 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                pending = {"time": time.monotonic(), "kill_step": step,
                           "restarts_before": job["restarts"]}
                if on_kill:
                    on_kill(len(kills) + 1, step)
        time.sleep(POLL_SECONDS)


def goodput_rounds(cluster, spec_path, runs, clean=True, on_kill=None):
    """Runs the goodput job `runs` times, each round a clean run (unless not `clean`) and then
    one with rank 1 killed every KILL_EVERY steps. Yields, per round, (clean run's (wall seconds,
    job) or None, faulted run's (wall seconds, kills, job)) as run_job returns them."""
    for _ in range(runs):
        clean_run = None
        if clean:
            wall, _, job = run_job(cluster, spec_path, 0)
            clean_run = (wall, job)
        yield clean_run, run_job(cluster, spec_path, KILL_EVERY, on_kill)


def projected_goodput(step_seconds, failures, recovery_seconds):
    useful = GOODPUT_STEPS * step_seconds
    lost = failures * (recovery_seconds + CHECKPOINT_INTERVAL / 2 * step_seconds)
    return useful / (useful + lost)


def measure(build_dir, trainer, workdir, args):
    shards = prepare_corpus(trainer, workdir, timeout=300)
    cluster = restart_cluster(build_dir, workdir)
    try:
        recovery_steps = RECOVERY_KILLS * KILL_EVERY + 50
        write_spec(f"{workdir}/recovery.yaml", "recovery", shards, recovery_steps)
        print(f"{BENCH}: recovery: {RECOVERY_KILLS} kills of rank 1, one every {KILL_EVERY} steps")
        _, kills, job = run_job(cluster, f"{workdir}/recovery.yaml", KILL_EVERY,
                                lambda n, s: print(f"  kill {n} at step {s}"))
        if len(kills) < RECOVERY_KILLS:
            raise BenchError(f"only {len(kills)} of {RECOVERY_KILLS} kills were timed")
        blamed = [a.get("reason", "") for a in job.get("attempts", [])[:-1]]
        if not all("rank 1" in r and "signal 9" in r for r in blamed):
            raise BenchError(f"an attempt blamed something else than the killed rank: {blamed}")

        write_spec(f"{workdir}/goodput.yaml", "goodput", shards, GOODPUT_STEPS)
        clean, faulted, clean_step_seconds = [], [], []
        rounds = goodput_rounds(cluster, f"{workdir}/goodput.yaml", args.runs)
        for r, ((clean_wall, clean_job), (wall, goodput_kills, _)) in enumerate(rounds):
            clean.append(clean_wall)
            clean_step_seconds.append(float(clean_job["latest_metrics"]["step_time_seconds"]))
            faulted.append(wall)
            print(f"  round {r + 1}: clean {clean[-1]:.1f} s, with {len(goodput_kills)} kills "
                  f"{faulted[-1]:.1f} s")
    finally:
        cluster.stop()

    first_step = [k["first_step"] for k in kills]
    median_recovery = statistics.median(first_step)
    goodput = [c / f for c, f in zip(clean, faulted)]
    failures = (GOODPUT_STEPS - 1) // KILL_EVERY
    return {
        "recovery": {
            "kill_to_restarting_seconds": spread([k["restarting"] for k in kills]),
            "kill_to_running_seconds": spread([k["running"] for k in kills]),
            "kill_to_first_step_seconds": spread(first_step),
            "kills": kills,
        },
        "goodput": {
            "steps": GOODPUT_STEPS, "kill_every": KILL_EVERY, "failures": failures,
            "clean_wall_seconds": spread(clean), "faulted_wall_seconds": spread(faulted),
            "goodput": spread(goodput),
            "measured_step_seconds": statistics.median(clean_step_seconds),
            "projected": {f"{t:g}s_steps": projected_goodput(t, failures, median_recovery)
                          for t in PROJECTED_STEP_SECONDS},
        },
    }


def median_step_seconds(cluster, job_id, skip=2, field="step_time_seconds"):
    """The median of a StepMetrics field (the step time) over a finished job's curve, its first
    `skip` steps (warm-up) left out."""
    out = cluster.cli("--output=json", "metrics", job_id)
    points = json.loads(out).get("points", [])
    values = [float(p.get(field, 0)) for p in points[skip:] if "step_time_seconds" in p]
    if not values:
        raise BenchError(f"{job_id}: no step times in its metrics")
    return statistics.median(values)


def lost_seconds(kill, step_seconds):
    """Wall time a failure cost: from the kill until the new attempt has trained back to the
    killed step (its first step, then the rest of the retrained ones at the run's step time)."""
    return kill["first_step"] + max(0, kill["retrained_steps"] - 1) * step_seconds


def measure_long_steps(build_dir, trainer, workdir, args):
    shards = prepare_corpus(trainer, workdir, timeout=300)
    cluster = restart_cluster(build_dir, workdir)
    steps, interval = args.goodput_steps, args.checkpoint_interval
    try:
        write_spec(f"{workdir}/calibrate.yaml", "calibrate", shards, CALIBRATION_STEPS,
                   long_step_batch=CALIBRATION_BATCH, interval=0)
        _, _, job = run_job(cluster, f"{workdir}/calibrate.yaml", 0)
        calibration = median_step_seconds(cluster, job["job_id"])
        # Compute grows with the batch; whole micro-batches on each of the two ranks.
        unit = 2 * LONG_STEP_MICRO_BATCH
        batch = max(unit, round(CALIBRATION_BATCH * args.step_seconds / calibration / unit) * unit)
        print(f"{BENCH}: calibration: {calibration:.3f} s steps at global batch "
              f"{CALIBRATION_BATCH}; sized to global batch {batch}")
        write_spec(f"{workdir}/goodput.yaml", "goodput", shards, steps, long_step_batch=batch,
                   interval=interval)
        clean, faulted, step_seconds, all_kills, derived, blocked = [], [], [], [], [], []
        rounds = goodput_rounds(cluster, f"{workdir}/goodput.yaml", args.runs,
                                clean=not args.faulted_only,
                                on_kill=lambda n, s: print(f"  kill {n} at step {s}"))
        for r, (clean_run, (wall, kills, job)) in enumerate(rounds):
            if clean_run is not None:
                clean.append(clean_run[0])
            faulted.append(wall)
            step_seconds.append(median_step_seconds(cluster, job["job_id"]))
            blocked.append(median_step_seconds(cluster, job["job_id"],
                                               field="checkpoint_blocked_seconds"))
            for k in kills:
                k["retrained_steps"] = k["kill_step"] - k["resume_step"]
                k["lost_seconds"] = lost_seconds(k, step_seconds[-1])
            all_kills += kills
            # The same run without its failures would have taken its wall time less what they
            # cost: a goodput that does not compare two runs a shared machine loads differently.
            derived.append(1 - sum(k["lost_seconds"] for k in kills) / wall)
            print(f"  round {r + 1}: with {len(kills)} kills {wall:.1f} s "
                  f"({step_seconds[-1]:.2f} s steps), lost "
                  f"{sum(k['lost_seconds'] for k in kills):.1f} s: goodput {derived[-1]:.1%}" +
                  (f"; clean run {clean[-1]:.1f} s, ratio {clean[-1] / wall:.1%}"
                   if clean else ""))
    finally:
        cluster.stop()
    if not all_kills:
        raise BenchError("no kill was timed")
    step = statistics.median(step_seconds)
    restarting = [k["restarting"] for k in all_kills]
    running = [k["running"] for k in all_kills]
    first = [k["first_step"] for k in all_kills]
    retrained = [k["retrained_steps"] for k in all_kills]
    lost = statistics.median(k["lost_seconds"] for k in all_kills)
    return {
        "step_seconds_target": args.step_seconds,
        "global_batch": batch,
        "calibration_step_seconds": calibration,
        "checkpoint_interval": interval,
        "goodput": {
            "steps": steps, "kill_every": KILL_EVERY, "runs": args.runs,
            "failures_per_run": [len(all_kills) // max(1, args.runs)],
            "measured_step_seconds": step,
            "checkpoint_blocked_seconds_per_step": statistics.median(blocked),
            "faulted_wall_seconds": spread(faulted),
            # 1 - (what the failures cost) / the faulted run's wall time, per run.
            "goodput": spread(derived),
            # One failure per KILL_EVERY steps at the measured step time and lost time.
            "goodput_one_failure_per_kill_every":
                KILL_EVERY * step / (KILL_EVERY * step + lost),
            # Clean run / faulted run wall times (without --faulted_only); skewed when the
            # machine's load changes between the two runs.
            "clean_wall_seconds": spread(clean) if clean else None,
            "wall_ratio": spread([c / f for c, f in zip(clean, faulted)]) if clean else None,
        },
        # Where a failure's time goes, per kill (seconds from the kill, cumulative), and the
        # steps trained again: the last checkpoint was behind the killed step by that many.
        "per_failure": {
            "kill_to_restarting_seconds": spread(restarting),
            "kill_to_running_seconds": spread(running),
            "kill_to_first_step_seconds": spread(first),
            "retrained_steps": spread(retrained),
            "retrained_seconds_estimate": statistics.median(retrained) * step,
            "lost_seconds": spread([k["lost_seconds"] for k in all_kills]),
            "kills": all_kills,
        },
    }


def main_long_steps(args, build_dir, trainer, started):
    workdir = tempfile.mkdtemp(prefix="tessera-fault-bench-")
    figures = in_workdir(BENCH, workdir, args.keep_workdir,
                         lambda: measure_long_steps(build_dir, trainer, workdir, args))
    if figures is None:
        return 1
    g, f = figures["goodput"], figures["per_failure"]
    print(f"{BENCH}: goodput with a rank killed every {KILL_EVERY} of {g['steps']} steps of "
          f"{g['measured_step_seconds']:.2f} s, checkpoints every "
          f"{figures['checkpoint_interval']} steps: median {g['goodput']['median']:.1%} over "
          f"{args.runs} run(s) ({g['goodput_one_failure_per_kill_every']:.1%} at one failure per "
          f"{KILL_EVERY} steps); per failure: lost {f['lost_seconds']['median']:.2f} s, RESTARTING "
          f"{f['kill_to_restarting_seconds']['median']:.2f} s, RUNNING "
          f"{f['kill_to_running_seconds']['median']:.2f} s, first step "
          f"{f['kill_to_first_step_seconds']['median']:.2f} s, "
          f"{f['retrained_steps']['median']:g} steps retrained")
    results = {
        "benchmark": BENCH,
        "method": __doc__,
        "config": {"kill_every": KILL_EVERY, "goodput_steps": args.goodput_steps,
                   "checkpoint_interval": args.checkpoint_interval, "runs": args.runs,
                   "step_seconds": args.step_seconds, "dims": LONG_STEP_DIMS,
                   "seq_len": LONG_STEP_SEQ_LEN},
        **figures,
        **provenance(trainer, trainer),
        "wall_seconds": time.monotonic() - started,
    }
    write_results(results, os.environ.get(RESULTS_ENV, os.path.join(build_dir, "bench", "results")),
                  f"{BENCH}-step{args.step_seconds:g}s.json", BENCH)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="goodput rounds (clean + faulted)")
    parser.add_argument("--keep_workdir", action="store_true")
    parser.add_argument("--step_seconds", type=float, default=0,
                        help="measure goodput with steps of about this many seconds (a wider "
                             "model, sized by calibration) instead of projecting it")
    parser.add_argument("--goodput_steps", type=int, default=300,
                        help="with --step_seconds: steps of the goodput job")
    parser.add_argument("--checkpoint_interval", type=int, default=2,
                        help="with --step_seconds: steps between checkpoints")
    parser.add_argument("--faulted_only", action="store_true",
                        help="with --step_seconds: no clean runs (goodput comes from the faulted "
                             "run's own lost time)")
    args = parser.parse_args()
    found = find_trainer(BENCH)
    if found is None:
        return 1
    build_dir, trainer = found
    started = time.monotonic()
    if args.step_seconds > 0:
        return main_long_steps(args, build_dir, trainer, started)
    workdir = tempfile.mkdtemp(prefix="tessera-fault-bench-")
    figures = in_workdir(BENCH, workdir, args.keep_workdir,
                         lambda: measure(build_dir, trainer, workdir, args))
    if figures is None:
        return 1
    r, g = figures["recovery"], figures["goodput"]
    print(f"{BENCH}: kill -9 of a rank -> RESTARTING median "
          f"{r['kill_to_restarting_seconds']['median']:.2f} s, -> RUNNING "
          f"{r['kill_to_running_seconds']['median']:.2f} s, -> first step of the next attempt "
          f"median {r['kill_to_first_step_seconds']['median']:.2f} s "
          f"(max {r['kill_to_first_step_seconds']['max']:.2f} s) over {len(r['kills'])} kills")
    print(f"{BENCH}: goodput with a rank killed every {KILL_EVERY} of {GOODPUT_STEPS} steps: "
          f"median {g['goodput']['median']:.1%} at {g['measured_step_seconds'] * 1000:.0f} ms "
          f"steps; projected " + ", ".join(f"{v:.1%} at {k.replace('s_steps', '')} s steps"
                                          for k, v in g["projected"].items()))
    results = {
        "benchmark": BENCH,
        "method": __doc__,
        "config": {"checkpoint_interval": CHECKPOINT_INTERVAL, "kill_every": KILL_EVERY,
                   "recovery_kills": RECOVERY_KILLS, "goodput_steps": GOODPUT_STEPS,
                   "runs": args.runs},
        **figures,
        **provenance(trainer, trainer),
        "wall_seconds": time.monotonic() - started,
    }
    write_results(results, os.environ.get(RESULTS_ENV, os.path.join(build_dir, "bench", "results")),
                  f"{BENCH}.json", BENCH)
    return 0


if __name__ == "__main__":
    sys.exit(main())
