#!/usr/bin/env python3
"""Tensor- and pipeline-parallel benchmark on CPU: tessera-trainer's 1F1B pipeline at pp=2 and 4
against the step time its bubble model predicts from a one-process run, and tensor parallelism at
tp=2 (with and without sequence parallelism) against tp=1, all measured in the same run.

    python bench/model_parallel_bench.py          # make bench BENCH=model-parallel

How it runs:
  1. `tessera-trainer prepare` tokenizes data/corpus/kjv-genesis-ruth.txt into byte-level shards.
  2. One job per configuration, the same in everything but the layout and the processes: the same
     model (GPT-2 blocks, 8 layers x 256, byte vocabulary: wide enough that a micro-batch is
     matrix work rather than per-operator overhead, small enough that a one-process step takes
     about half a second), the same data, seed, global batch and micro-batch (so m = 8
     micro-batches per step in every configuration; data parallelism is 1 throughout), fp32.
     Each rank is its own process over Gloo (RANK, WORLD_SIZE, ... MASTER_PORT as torchrun sets
     them) with OMP_NUM_THREADS = MKL_NUM_THREADS = its thread count.
  3. Configurations (CONFIGS): pp1 (1 process, 1 thread: the baseline of both halves), pp2, pp4
     (1 thread per stage), tp1-2threads (1 process, 2 threads: the same cores as tp=2), tp2 and
     tp2-sp (2 processes x 1 thread, the latter with --sequence_parallel).
  4. Runs are interleaved, each a fresh set of processes: pp1, pp2, pp4, tp1-2threads, tp2,
     tp2-sp, pp1, ... (--runs rounds), so that drifting load falls on every configuration alike.
  5. A run's step time is the median of rank 0's per-step step_time_seconds over the timed steps
     (the first untimed_steps, process start-up and rendezvous excluded). Rank 0 is pipeline
     stage 0, which runs the step's last backward, and every step ends in collectives over all
     ranks (loss, gradient norm), so its step time is the whole pipeline's.
  6. Pipeline prediction (the planner's 1F1B model, planner/layout_model.cc): each stage does 1/pp
     of a micro-batch's work and the schedule takes m + pp - 1 micro-batch slots, so
     predicted = T1 / pp * (m + pp - 1) / m, T1 the pp1 run's step time; the bubble is
     (pp - 1) / (m + pp - 1) of the step. Reported: measured / predicted, and the bubble fraction
     the measurement implies, 1 - (T1 / pp) / measured (everything that is not a stage's share of
     the work counts as bubble: point-to-point transfers, stage imbalance, step collectives).
     Where a configuration has more processes than the cores this process may run on, the
     prediction is also given scaled by procs / cores (each single-threaded stage then gets
     cores / procs of a core while all are busy), and the work bound T1 / cores.
  7. Tensor parallel: step time of tp2 and tp2-sp over pp1 (1 thread, same global batch) and over
     tp1-2threads (the same two cores given to one process as intra-op threads).
  8. Every configuration must compute the same thing before a figure is believed: equal parameter
     counts, the layout the trainer reports ("tp r/N, pp r/N" in its start-up log line) equal to
     the one asked for, and every run's first-step loss (same initial weights, same data) within
     LOSS_TOLERANCE_FIRST (relative) of the first pp1 run's, later steps within LOSS_TOLERANCE;
     otherwise the benchmark fails.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/model-parallel.json with medians, min/max
ranges, ratios (by round and of medians), every run's figures, the configuration, method, machine,
date and commit. The environment of scripts/bench.sh is optional; missing values fall back to
local defaults. Only the standard library is used.
"""

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

from bench_common import (RESULTS_ENV, RUN_TIMEOUT_SECONDS, BenchError, find_trainer, in_workdir,
                          loss_diffs, prepare_corpus, provenance, run_ranks, spread, step_reports,
                          tail, write_cpu_spec, write_results)


# The first step's loss is computed from the initial weights on the first batch: every layout
# must reproduce it up to the order of fp32 sums (tensor parallelism splits the matmuls' inner
# dimensions, two threads split them differently). Later steps compound that rounding through
# the gradient-norm clip and AdamW, hence the looser bound (bench/trainer_bench.py's fp32 one).
LOSS_TOLERANCE_FIRST = 1e-5
LOSS_TOLERANCE = 1e-4
# Interval at which the driver looks for finished ranks.
POLL_SECONDS = 0.05

# GPT-2 blocks, 8 layers of width 256 (8 heads, ffn 1024) with a byte vocabulary: 6.4M parameters,
# all but 0.1M in the layers, so the embedding on the first stage and the tied head and loss on
# the last are about 1% of the work and the stages are nearly balanced. 8 heads and ffn 1024
# divide by tp=2; 8 layers by pp=2 and 4. A micro-batch of 2 x 128 tokens is matrix work
# (256 x 256 x 1024 products), not operator overhead, so splitting it by layers or by columns
# divides the time. Global batch 16 of micro-batch 2: m = 8 micro-batches per step everywhere.
CONFIG = {
    "name": "gpt2-8x256-byte",
    "model": {"dims": {"architecture": "ARCHITECTURE_GPT2", "num_layers": 8, "hidden_size": 256,
                       "num_attention_heads": 8, "vocab_size": 257, "max_seq_len": 128,
                       "tie_embeddings": True}},
    "seq_len": 128,
    "global_batch_size": 16,
    "micro_batch_size": 2,
    "untimed_steps": 2,
    "timed_steps": 6,
    "activation_checkpointing": "ACTIVATION_CHECKPOINTING_NONE",
    "seed": 7,
    "optimizer": {"schedule": {"peak_learning_rate": 3e-4, "warmup_steps": 2,
                               "min_lr_ratio": 0.1, "decay_steps": 0},
                  "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8,
                  "grad_clip_norm": 1.0},
}
MICRO_BATCHES = CONFIG["global_batch_size"] // CONFIG["micro_batch_size"]

# name, layout, processes and intra-op threads per process. The first is the baseline.
CONFIGS = (
    {"name": "pp1", "tp": 1, "pp": 1, "sp": False, "procs": 1, "threads": 1},
    {"name": "pp2", "tp": 1, "pp": 2, "sp": False, "procs": 2, "threads": 1},
    {"name": "pp4", "tp": 1, "pp": 4, "sp": False, "procs": 4, "threads": 1},
    {"name": "tp1-2threads", "tp": 1, "pp": 1, "sp": False, "procs": 1, "threads": 2},
    {"name": "tp2", "tp": 2, "pp": 1, "sp": False, "procs": 2, "threads": 1},
    {"name": "tp2-sp", "tp": 2, "pp": 1, "sp": True, "procs": 2, "threads": 1},
)
BASELINE = "pp1"
SAME_CORES_BASELINE = "tp1-2threads"

# "(dp 0/1, tp 0/2, pp 0/1)" in the trainer's start-up line: this rank's coordinates and sizes.
MESH_LINE = re.compile(r"\(dp (\d+)/(\d+), tp (\d+)/(\d+), pp (\d+)/(\d+)\)")


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# --- processes --------------------------------------------------------------------------------


def launch(trainer, task_path, world, threads, workdir, label):
    """Runs one job's ranks (run_ranks). Returns, per rank, what the kernel counted for its
    process, and the load average before."""
    procs, load_before = run_ranks(trainer, task_path, world, threads, workdir, label,
                                   RUN_TIMEOUT_SECONDS, POLL_SECONDS)
    return [{"rank": p["rank"], "out": p["out"], "err": p["err"],
             "user_cpu_seconds": p["rusage"].ru_utime,
             "system_cpu_seconds": p["rusage"].ru_stime,
             "process_seconds": p["seconds"],
             "peak_rss_bytes": p["rusage"].ru_maxrss * 1024} for p in procs], load_before


# --- reports ----------------------------------------------------------------------------------


def check_mesh(config, rank, what):
    """Fails unless the rank's start-up line reports the layout the configuration asked for."""
    with open(rank["err"], errors="replace") as f:
        match = MESH_LINE.search(f.read())
    if not match:
        raise BenchError(f"{what}: no '(dp r/N, tp r/N, pp r/N)' line in {rank['err']}:\n"
                         f"{tail(rank['err'])}")
    _, dp, _, tp, _, pp = (int(x) for x in match.groups())
    if (dp, tp, pp) != (1, config["tp"], config["pp"]):
        raise BenchError(f"{what}: the trainer runs dp {dp}, tp {tp}, pp {pp}; the benchmark "
                         f"asked for dp 1, tp {config['tp']}, pp {config['pp']}")
    return match.group(0)


def summarize_run(config, ranks, load_before, what):
    """The figures of one run: rank 0's step reports, every rank's CPU time."""
    started, metrics = step_reports(ranks[0], CONFIG["untimed_steps"] + CONFIG["timed_steps"],
                                    what)
    mesh = [check_mesh(config, r, f"{what} rank {r['rank']}") for r in ranks]
    times = [float(m["step_time_seconds"]) for m in metrics]
    timed = times[CONFIG["untimed_steps"]:]
    per_rank = []
    for r, line in zip(ranks, mesh):
        entry = {k: v for k, v in r.items() if k not in ("out", "err")}
        entry["mesh"] = line
        per_rank.append(entry)
    return {
        "config": config["name"],
        "step_time_seconds": statistics.median(timed),
        "step_time_seconds_mean": sum(timed) / len(timed),
        "step_times_seconds": times,
        "losses": [float(m["loss"]) for m in metrics],
        "grad_norms": [float(m.get("grad_norm", 0.0)) for m in metrics],
        "num_parameters": int(started.get("num_parameters", 0)),
        "ranks": per_rank,
        # CPU seconds of all ranks over the process lifetime of rank 0: above `cores` means
        # the run wanted more CPU than it could get alone.
        "cpu_seconds_all_ranks": sum(r["user_cpu_seconds"] + r["system_cpu_seconds"]
                                     for r in ranks),
        # Each rank's CPU seconds over its lifetime, averaged over ranks: near 1 for a
        # single-threaded rank that is never waiting (on a peer or for a core).
        "cpu_share_per_rank": sum((r["user_cpu_seconds"] + r["system_cpu_seconds"]) /
                                  max(r["process_seconds"], 1e-9) for r in ranks) / len(ranks),
        "load_average_before": load_before,
    }


# --- statistics and checks --------------------------------------------------------------------


def check_same_computation(run, reference, what):
    """Fails unless `run` trained the same model on the same data as `reference`. Returns the
    relative loss differences (first step, largest later one)."""
    diffs = loss_diffs(run, reference, what, BASELINE, "layouts", 1, LOSS_TOLERANCE_FIRST,
                       LOSS_TOLERANCE)
    return diffs[0], max(diffs[1:], default=0.0)


def grad_norm_diff(run, reference):
    """Largest relative difference of the reported gradient norms (informational: they show
    that the layouts summed in different orders even where the float32 losses agree exactly)."""
    return max(abs(a - b) / max(abs(b), 1e-30)
               for a, b in zip(run["grad_norms"], reference["grad_norms"]))


def write_task(path, config, shards):
    write_cpu_spec(path, "model-parallel-bench", config["name"], CONFIG, shards,
                   {"zero_stage": 0, "tensor_parallel": config["tp"],
                    "pipeline_parallel": config["pp"], "sequence_parallel": config["sp"],
                    "activation_checkpointing_mode": CONFIG["activation_checkpointing"]},
                   config["procs"])


def ratio(runs, base_runs):
    """Median over rounds of run / baseline within the round, with its range, and the ratio of
    the medians."""
    by_round = [r["step_time_seconds"] / b["step_time_seconds"] for r, b in zip(runs, base_runs)]
    return {"of_medians": statistics.median(r["step_time_seconds"] for r in runs) /
            statistics.median(b["step_time_seconds"] for b in base_runs),
            "by_round": spread(by_round)}


def pipeline_figures(config, runs, base_runs, cores):
    """Measured against the 1F1B prediction from the same round's pp1 step time."""
    pp, m = config["pp"], MICRO_BATCHES
    slots = (m + pp - 1) / m
    oversubscription = max(1.0, config["procs"] * config["threads"] / cores)
    measured = [r["step_time_seconds"] for r in runs]
    t1 = [b["step_time_seconds"] for b in base_runs]
    predicted = [t / pp * slots for t in t1]
    return {
        "predicted_bubble_fraction": (pp - 1) / (m + pp - 1),
        "predicted_step_time_seconds": spread(predicted),
        "measured_over_predicted": spread([a / p for a, p in zip(measured, predicted)]),
        "implied_bubble_fraction": spread([1 - (t / pp) / a for a, t in zip(measured, t1)]),
        "oversubscription": oversubscription,
        "measured_over_predicted_scaled": spread(
            [a / (p * oversubscription) for a, p in zip(measured, predicted)]),
        "implied_bubble_fraction_scaled": spread(
            [1 - (t / pp * oversubscription) / a for a, t in zip(measured, t1)]),
        "measured_over_work_bound": spread([a / (t / min(cores, config["procs"]))
                                            for a, t in zip(measured, t1)]),
    }


def summarize_config(config, runs, runs_by_name, cores):
    times = [r["step_time_seconds"] for r in runs]
    summary = {
        "config": config,
        "step_time_seconds": spread(times),
        "tokens_per_second": spread([CONFIG["global_batch_size"] * CONFIG["seq_len"] / t
                                     for t in times]),
        "cpu_seconds_all_ranks": spread([r["cpu_seconds_all_ranks"] for r in runs]),
        "cpu_share_per_rank": spread([r["cpu_share_per_rank"] for r in runs]),
        "vs_pp1": ratio(runs, runs_by_name[BASELINE]),
    }
    if config["pp"] > 1:
        summary["pipeline"] = pipeline_figures(config, runs, runs_by_name[BASELINE], cores)
    if config["tp"] > 1:
        summary["vs_tp1_2threads"] = ratio(runs, runs_by_name[SAME_CORES_BASELINE])
    summary["runs"] = runs
    return summary


def print_summary(results):
    m = results["method"]
    print()
    print(f"Model-parallel benchmark ({results['config']['name']}, {results['num_parameters']:,} "
          f"parameters, m = {MICRO_BATCHES} micro-batches of {CONFIG['micro_batch_size']} x "
          f"{CONFIG['seq_len']} tokens, CPU/Gloo, {m['cores']} cores): median [min, max] of "
          f"{m['rounds']} interleaved runs; ratios by round, median (min-max)")
    print(f"  {'config':<13} {'procs x thr':>11} {'step s':>22} {'vs pp1':>18} "
          f"{'vs tp1-2thr':>18}")
    for c in results["configs"]:
        t, v = c["step_time_seconds"], c["vs_pp1"]["by_round"]
        line = (f"  {c['config']['name']:<13} {c['config']['procs']:>5} x {c['config']['threads']:<3}"
                f" {t['median']:>7.3f} [{t['min']:.3f}, {t['max']:.3f}]"
                f"  {v['median']:>5.3f} ({v['min']:.2f}-{v['max']:.2f})")
        if "vs_tp1_2threads" in c:
            w = c["vs_tp1_2threads"]["by_round"]
            line += f"  {w['median']:>5.3f} ({w['min']:.2f}-{w['max']:.2f})"
        print(line)
    print("  pipeline (1F1B): predicted = T(pp1) / pp * (m + pp - 1) / m")
    for c in results["configs"]:
        if "pipeline" not in c:
            continue
        p = c["pipeline"]
        r, b = p["measured_over_predicted"], p["implied_bubble_fraction"]
        line = (f"    pp={c['config']['pp']}: predicted {p['predicted_step_time_seconds']['median']:.3f}"
                f" s, measured/predicted {r['median']:.3f} ({r['min']:.2f}-{r['max']:.2f}); "
                f"bubble predicted {p['predicted_bubble_fraction']:.3f}, implied "
                f"{b['median']:.3f}")
        if p["oversubscription"] > 1:
            s, w = p["measured_over_predicted_scaled"], p["measured_over_work_bound"]
            line += (f"; {c['config']['procs']} processes on {m['cores']} cores: measured / "
                     f"(predicted x {p['oversubscription']:g}) {s['median']:.3f} "
                     f"({s['min']:.2f}-{s['max']:.2f}), measured / (T(pp1) / {m['cores']}) "
                     f"{w['median']:.3f}")
        print(line)
    print(f"  first-step losses agree within {results['loss_first_step_max_rel_diff']:.3g} "
          f"relative (tolerance {LOSS_TOLERANCE_FIRST:g}), later steps within "
          f"{results['loss_later_max_rel_diff']:.3g} ({LOSS_TOLERANCE:g}); gradient norms within "
          f"{results['grad_norm_max_rel_diff']:.3g}; 1-minute load average "
          f"before runs: {min(results['load_averages']):.1f}-{max(results['load_averages']):.1f}")


def main():
    parser = argparse.ArgumentParser(
        description="tessera-trainer pipeline (pp=2, 4) and tensor (tp=2) parallelism on CPU "
                    "against a one-process run: step times, 1F1B bubble vs prediction.")
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds of all configs")
    parser.add_argument("--timed-steps", type=int, default=CONFIG["timed_steps"],
                        help="timed steps per run (after %d untimed)" % CONFIG["untimed_steps"])
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the shards, tasks and every rank's output")
    args = parser.parse_args()
    if args.runs < 1 or args.timed_steps < 1:
        parser.error("--runs and --timed-steps must be >= 1")
    CONFIG["timed_steps"] = args.timed_steps

    found = find_trainer("model_parallel_bench")
    if not found:
        return 2
    build_dir, built = found
    results_dir = os.environ.get(RESULTS_ENV) or os.path.join(build_dir, "bench", "results")
    cores = usable_cores()

    workdir = tempfile.mkdtemp(prefix="tessera-model-parallel-bench-")
    # Every run uses one copy of the binary, so a rebuild during the benchmark cannot mix builds.
    trainer = os.path.join(workdir, "tessera-trainer")
    shutil.copy2(built, trainer)
    results = {
        "benchmark": "model-parallel",
        "device": "cpu",
        **provenance(built, trainer),
        "config": CONFIG,
        "micro_batches_per_step": MICRO_BATCHES,
        "method": {
            "cores": cores,
            "cores_how": "CPUs this process may run on (sched_getaffinity)",
            "threads_how": "OMP_NUM_THREADS and MKL_NUM_THREADS of every rank",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or
            "unset (the OpenMP runtime's default: spin, then sleep)",
            "rounds": args.runs,
            "order": "interleaved, each run a fresh set of rank processes: " +
                     ", ".join(c["name"] for c in CONFIGS) + ", then again",
            "baseline": f"{BASELINE}: one process, one thread, the same global batch and "
                        f"micro-batch; {SAME_CORES_BASELINE}: one process with two intra-op "
                        "threads (the cores tp2 uses)",
            "statistic": "median over runs; ranges are min and max; *.by_round divides the "
                         "i-th runs and summarizes those ratios; of_medians divides the medians",
            "timing": "a run's step time = median of rank 0's step_time_seconds over the timed "
                      "steps; process start-up, Gloo rendezvous, model construction and the "
                      "first untimed_steps are excluded",
            "pipeline_prediction": "predicted = T(pp1) / pp * (m + pp - 1) / m with T(pp1) from "
                                   "the same round; predicted bubble fraction (pp - 1) / "
                                   "(m + pp - 1); implied bubble fraction 1 - (T(pp1) / pp) / "
                                   "measured (transfers, stage imbalance and per-step "
                                   "collectives count as bubble)",
            "oversubscription": "when procs x threads > cores, *_scaled multiplies the "
                                "prediction by procs x threads / cores (every stage busy, each "
                                "gets cores / procs of a core) and measured_over_work_bound "
                                "divides by T(pp1) / cores (all the work spread over all cores, "
                                "bubbles filled by other stages); the unscaled ratio then "
                                "measures the shortage of cores, not the schedule",
            "equivalence": f"the first step's loss of every run within {LOSS_TOLERANCE_FIRST:g} "
                           f"relative of the first {BASELINE} run's, later steps within "
                           f"{LOSS_TOLERANCE:g}, equal parameter counts, every rank's reported "
                           "(dp, tp, pp) sizes as asked; else the benchmark fails",
            "data": "data/corpus/kjv-genesis-ruth.txt, byte tokenizer (vocabulary 257)",
            "load": "each run records the 1-minute load average before it started, every "
                    "rank's user and system CPU seconds, and cpu_share_per_rank (CPU seconds / "
                    "lifetime, averaged over ranks; pp1's is near 1 on a quiet machine): other "
                    "work on the machine shows there",
        },
        "configs": [],
    }

    def measure():
        shards = prepare_corpus(trainer, workdir, RUN_TIMEOUT_SECONDS)
        tasks = {}
        for config in CONFIGS:
            tasks[config["name"]] = os.path.join(workdir, f"{config['name']}.spec.json")
            write_task(tasks[config["name"]], config, shards)
        print(f"model_parallel_bench: {CONFIG['name']}, {args.runs} rounds of "
              f"{[c['name'] for c in CONFIGS]}, {CONFIG['untimed_steps']} untimed + "
              f"{CONFIG['timed_steps']} timed steps, {cores} usable cores; {results['machine']}",
              flush=True)
        runs = {c["name"]: [] for c in CONFIGS}
        reference = None
        first_diff = later_diff = grad_diff = 0.0
        for round_index in range(args.runs):
            for config in CONFIGS:
                label = f"{config['name']}.round{round_index + 1}"
                ranks, load = launch(trainer, tasks[config["name"]], config["procs"],
                                     config["threads"], workdir, label)
                run = summarize_run(config, ranks, load, label)
                if reference is None:
                    reference = run
                first, later = check_same_computation(run, reference, label)
                first_diff, later_diff = max(first_diff, first), max(later_diff, later)
                grad_diff = max(grad_diff, grad_norm_diff(run, reference))
                runs[config["name"]].append(run)
                print(f"  round {round_index + 1} {config['name']:<13} step "
                      f"{run['step_time_seconds']:.3f} s (timed steps "
                      f"{', '.join('%.3f' % t for t in run['step_times_seconds'][CONFIG['untimed_steps']:])}), "
                      f"CPU {run['cpu_seconds_all_ranks']:.1f} s ("
                      f"{run['cpu_share_per_rank']:.2f} of a core per rank), first loss "
                      f"{run['losses'][0]:.6f} (load average before: "
                      f"{run['load_average_before']:.1f})", flush=True)
        return runs, reference, first_diff, later_diff, grad_diff

    start = time.perf_counter()
    measured = in_workdir("model_parallel_bench", workdir, args.keep_workdir, measure)
    if measured is None:
        return 1
    runs, reference, first_diff, later_diff, grad_diff = measured

    results["wall_seconds"] = time.perf_counter() - start
    results["num_parameters"] = reference["num_parameters"]
    results["loss_first_step_max_rel_diff"] = first_diff
    results["loss_later_max_rel_diff"] = later_diff
    results["grad_norm_max_rel_diff"] = grad_diff
    results["load_averages"] = [r["load_average_before"] for c in CONFIGS for r in runs[c["name"]]]
    results["configs"] = [summarize_config(c, runs[c["name"]], runs, cores) for c in CONFIGS]
    print_summary(results)
    write_results(results, results_dir, "model-parallel.json", "model_parallel_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
