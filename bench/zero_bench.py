#!/usr/bin/env python3
"""ZeRO benchmark: tessera-trainer data parallel with ZeRO stages 1, 2 and 3 against ZeRO-0 (plain
all-reduce data parallelism, what DDP does), measured in the same run: tokens/s and each rank's
measured peak memory.

    python bench/zero_bench.py            # make bench BENCH=zero

How it runs:
  1. `tessera-trainer prepare` tokenizes data/corpus/kjv-genesis-ruth.txt into byte-level shards.
  2. One job per stage, the same in everything but parallelism.layout.zero_stage: the same model
     (a GPT-2 shape of about 100M parameters with a byte vocabulary, large enough that weights,
     gradients and AdamW moments, 16 bytes per parameter at ZeRO-0, outweigh LibTorch's own
     resident floor), the same data, seed, batch and schedule, fp32, on --ranks CPU processes
     over Gloo (RANK, WORLD_SIZE, ... MASTER_PORT as torchrun sets them), each with --threads
     intra-op threads (OMP_NUM_THREADS, MKL_NUM_THREADS).
  3. Runs are interleaved, each a fresh set of processes: ZeRO 0, 1, 2, 3, ZeRO 0, 1, 2, 3, ...
     (--runs rounds), so that drifting load on the machine falls on every stage alike.
  4. Throughput: a run's tokens/s is the median of rank 0's per-step tokens_per_second over the
     timed steps; the first untimed_steps (allocator and data-order warm-up) and process start-up
     are excluded. tokens/s from the sum of the timed steps' times is recorded too.
  5. Memory, per rank: the peak resident set of each rank's process, read by this script when the
     process ends (wait4's ru_maxrss, as /usr/bin/time -v reports it; the trainer's own
     peak_memory_bytes on CPU is the same counter, but only rank 0 reports). Also recorded: the
     training state the rank holds, from its log line "this rank holds X MiB of parameters, Y MiB
     of gradients, Z MiB of optimizer state", its minor page faults and CPU seconds, and a
     resident-set timeline sampled every SAMPLE_SECONDS from /proc/PID/status.
  6. The stages must compute the same thing before a figure is believed: equal parameter counts
     and every step's loss of every run within LOSS_TOLERANCE (relative) of the first ZeRO-0
     run's; otherwise the benchmark fails.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/zero.json with medians, min/max ranges,
ratios against ZeRO-0, every run's figures, the configuration, method, machine, date and commit.
The environment of scripts/bench.sh is optional; missing values fall back to local defaults.
Only the standard library is used (no torch: the driver's own memory stays small).
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


# Every stage runs the same arithmetic on the same data; they differ only in how gradients are
# reduced (all-reduce vs reduce-scatter) and where AdamW runs. The first EXACT_STEPS losses (the
# initial weights and one update) must agree to LOSS_TOLERANCE_FIRST; later ones to LOSS_TOLERANCE
# (bench/trainer_bench.py's fp32 bound), because the sharded stages sum the gradient norm's squares
# shard by shard, so the clip factor differs in its last bits and the difference compounds step
# by step (observed: identical for two steps, 2e-6 at step 3, 3e-5 at step 7).
LOSS_TOLERANCE_FIRST = 1e-5
EXACT_STEPS = 2
LOSS_TOLERANCE = 1e-4
# Interval of the resident-set timeline read from /proc/PID/status.
SAMPLE_SECONDS = 0.1

STAGES = (0, 1, 2, 3)

# GPT-2 blocks, 8 layers of width 1024 (16 heads) with a byte vocabulary: 101.1M parameters, of
# which all but 0.3M are in the layers, so ZeRO-3's sharded units are nearly the whole model and
# its always-gathered outer unit (embeddings, final norm, tied head) is small. fp32 AdamW state at
# ZeRO-0 is 1.5 GiB per rank. A short context and one micro-batch of 2 sequences per rank keep a
# step at a few seconds on two shared cores; activations are then small next to the state.
CONFIG = {
    "name": "gpt2-8x1024-byte",
    "model": {"dims": {"architecture": "ARCHITECTURE_GPT2", "num_layers": 8, "hidden_size": 1024,
                       "num_attention_heads": 16, "vocab_size": 257, "max_seq_len": 64,
                       "tie_embeddings": True}},
    "seq_len": 64,
    "global_batch_size": 4,
    "micro_batch_size": 2,
    "untimed_steps": 2,
    "timed_steps": 5,
    "activation_checkpointing": "ACTIVATION_CHECKPOINTING_NONE",
    "seed": 7,
    "optimizer": {"schedule": {"peak_learning_rate": 3e-4, "warmup_steps": 2,
                               "min_lr_ratio": 0.1, "decay_steps": 0},
                  "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8,
                  "grad_clip_norm": 1.0},
}

# A model of 0.1M parameters, run once at ZeRO-0 with the same ranks and batch: its peak resident
# set is what a rank costs without training state to speak of (LibTorch, Gloo, activations).
FLOOR_MODEL = {"dims": {"architecture": "ARCHITECTURE_GPT2", "num_layers": 2, "hidden_size": 64,
                        "num_attention_heads": 4, "vocab_size": 257, "max_seq_len": 64,
                        "tie_embeddings": True}}

# The target for ZeRO-3 against ZeRO-0 on CPU.
TARGET = {"zero3_tokens_per_second_ratio_min": 0.85, "zero3_peak_memory_ratio_max": 0.5}

STATE_LINE = re.compile(r"this rank holds ([0-9.]+) MiB of parameters, ([0-9.]+) MiB of "
                        r"gradients, ([0-9.]+) MiB of optimizer state")


# --- processes --------------------------------------------------------------------------------


def read_rss_kib(pid):
    """VmRSS and VmHWM of a live process in KiB, or None once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def sample_rss(timeline):
    """An on_poll for run_ranks: appends [seconds since launch, RSS KiB of rank 0, rank 1, ...]
    (None for a rank that has ended) to `timeline` and keeps each live rank's VmHWM."""
    def sample(now, procs):
        row = [round(now, 2)]
        for p in procs:
            rss = None if "rusage" in p else read_rss_kib(p["popen"].pid)
            row.append(rss[0] if rss else None)
            if rss:
                p["vm_hwm_kib"] = rss[1]
        timeline.append(row)
    return sample


def launch(trainer, task_path, world, threads, workdir, label):
    """Runs one job's ranks (run_ranks). Returns, per rank, what the kernel counted for its
    process, plus the load average before and a resident-set timeline."""
    timeline = []
    procs, load_before = run_ranks(trainer, task_path, world, threads, workdir, label,
                                   RUN_TIMEOUT_SECONDS, SAMPLE_SECONDS, sample_rss(timeline))
    ranks = []
    for p in procs:
        usage = p["rusage"]
        ranks.append({
            "rank": p["rank"], "out": p["out"], "err": p["err"],
            "peak_rss_bytes": usage.ru_maxrss * 1024,
            "last_sampled_vm_hwm_bytes": p.get("vm_hwm_kib", 0) * 1024,
            "minor_page_faults": usage.ru_minflt,
            "user_cpu_seconds": usage.ru_utime,
            "system_cpu_seconds": usage.ru_stime,
            "process_seconds": p["seconds"],
        })
    # Every other sample is enough to show where the peak falls.
    return ranks, {"load_average_before": load_before, "rss_timeline_kib": timeline[::2]}


# --- reports ----------------------------------------------------------------------------------


def state_mib(path, what):
    with open(path, errors="replace") as f:
        match = STATE_LINE.search(f.read())
    if not match:
        raise BenchError(f"{what}: no 'this rank holds ... MiB' line in {path}:\n{tail(path)}")
    params, grads, optimizer = (float(x) for x in match.groups())
    return {"parameters_mib": params, "gradients_mib": grads, "optimizer_state_mib": optimizer,
            "total_mib": params + grads + optimizer}


def summarize_run(stage, ranks, process, what):
    """The figures of one run: rank 0's step reports, every rank's memory."""
    started, metrics = step_reports(ranks[0], CONFIG["untimed_steps"] + CONFIG["timed_steps"],
                                    what)
    timed = metrics[CONFIG["untimed_steps"]:]
    tokens_per_step = CONFIG["global_batch_size"] * CONFIG["seq_len"]
    timed_times = [float(m["step_time_seconds"]) for m in timed]
    per_rank = []
    for r in ranks:
        entry = {k: v for k, v in r.items() if k not in ("out", "err")}
        entry["state"] = state_mib(r["err"], f"{what} rank {r['rank']}")
        per_rank.append(entry)
    # The timeline's sample at rank 0's start report: the training state is allocated, no step
    # has run. Report times are UTC wall clock; the timeline counts from the launch.
    return {
        "stage": stage,
        "tokens_per_second": statistics.median(float(m["tokens_per_second"]) for m in timed),
        "tokens_per_second_from_sum": tokens_per_step * len(timed) / sum(timed_times),
        "step_time_seconds": [float(m["step_time_seconds"]) for m in metrics],
        "losses": [float(m["loss"]) for m in metrics],
        "grad_norms": [float(m.get("grad_norm", 0.0)) for m in metrics],
        "num_parameters": int(started.get("num_parameters", 0)),
        "rank0_reported_peak_memory_bytes": max(int(m.get("peak_memory_bytes", 0))
                                                for m in metrics),
        "peak_rss_bytes_max_over_ranks": max(r["peak_rss_bytes"] for r in per_rank),
        "ranks": per_rank,
        **process,
    }


# --- statistics and checks --------------------------------------------------------------------


def check_same_computation(run, reference, what):
    """Fails unless `run` trained the same model on the same data as `reference`."""
    return max(loss_diffs(run, reference, what, "ZeRO-0", "stages", EXACT_STEPS,
                          LOSS_TOLERANCE_FIRST, LOSS_TOLERANCE))


def write_task(path, stage, shards, world, model=None):
    write_cpu_spec(path, "zero-bench", stage, CONFIG, shards,
                   {"zero_stage": stage,
                    "activation_checkpointing_mode": CONFIG["activation_checkpointing"]}, world,
                   model)


def summarize_stage(stage, runs, baseline_runs):
    tps = [r["tokens_per_second"] for r in runs]
    peak = [r["peak_rss_bytes_max_over_ranks"] for r in runs]
    base_tps = statistics.median(r["tokens_per_second"] for r in baseline_runs)
    base_peak = statistics.median(r["peak_rss_bytes_max_over_ranks"] for r in baseline_runs)
    state = runs[0]["ranks"][0]["state"]["total_mib"]
    base_state = baseline_runs[0]["ranks"][0]["state"]["total_mib"]
    return {
        "stage": stage,
        "tokens_per_second": spread(tps),
        "tokens_per_second_from_sum": spread([r["tokens_per_second_from_sum"] for r in runs]),
        "peak_rss_bytes_max_over_ranks": spread(peak),
        "peak_rss_bytes_by_rank": {str(i): spread([r["ranks"][i]["peak_rss_bytes"] for r in runs])
                                   for i in range(len(runs[0]["ranks"]))},
        "state_mib_per_rank": runs[0]["ranks"][0]["state"],
        "minor_page_faults_per_rank": spread([r["ranks"][0]["minor_page_faults"] for r in runs]),
        "system_cpu_seconds_per_rank": spread([r["ranks"][0]["system_cpu_seconds"]
                                               for r in runs]),
        "ratio_tokens_per_second_vs_zero0": statistics.median(tps) / base_tps,
        "ratio_tokens_per_second_by_round": spread(
            [r["tokens_per_second"] / b["tokens_per_second"]
             for r, b in zip(runs, baseline_runs)]),
        "ratio_peak_rss_vs_zero0": statistics.median(peak) / base_peak,
        "ratio_peak_rss_by_round": spread(
            [r["peak_rss_bytes_max_over_ranks"] / b["peak_rss_bytes_max_over_ranks"]
             for r, b in zip(runs, baseline_runs)]),
        "ratio_state_bytes_vs_zero0": state / base_state,
        "runs": runs,
    }


def print_summary(results):
    m = results["method"]
    print()
    print(f"ZeRO benchmark ({results['config']['name']}, {results['num_parameters']:,} "
          f"parameters, {m['ranks']} ranks x {m['threads_per_rank']} thread(s), CPU/Gloo): "
          f"median [min, max] of {m['rounds']} interleaved runs per stage")
    print(f"  {'stage':<6} {'tokens/s':>22} {'vs ZeRO-0':>18} {'peak RSS/rank GiB':>24} "
          f"{'vs ZeRO-0':>18} {'state MiB':>10} {'vs 0':>6}")
    for s in results["stages"]:
        t, p = s["tokens_per_second"], s["peak_rss_bytes_max_over_ranks"]
        rt, rp = s["ratio_tokens_per_second_by_round"], s["ratio_peak_rss_by_round"]
        gib = 2 ** 30
        print(f"  ZeRO-{s['stage']:<1} {t['median']:>7.1f} [{t['min']:.1f}, {t['max']:.1f}]"
              f"  {s['ratio_tokens_per_second_vs_zero0']:>5.3f} ({rt['min']:.2f}-{rt['max']:.2f})"
              f"  {p['median'] / gib:>7.2f} [{p['min'] / gib:.2f}, {p['max'] / gib:.2f}]"
              f"  {s['ratio_peak_rss_vs_zero0']:>5.3f} ({rp['min']:.2f}-{rp['max']:.2f})"
              f"  {s['state_mib_per_rank']['total_mib']:>9.1f} "
              f"{s['ratio_state_bytes_vs_zero0']:>6.3f}")
    target = results["target"]
    print(f"  target (ZeRO-3 >= {TARGET['zero3_tokens_per_second_ratio_min']:.2f}x ZeRO-0 "
          f"tokens/s at <= {TARGET['zero3_peak_memory_ratio_max']:.2f}x its peak memory per "
          f"rank): tokens/s ratio {target['zero3_tokens_per_second_ratio']:.3f}, peak memory "
          f"ratio {target['zero3_peak_memory_ratio']:.3f}, state ratio "
          f"{target['zero3_state_ratio']:.3f}: {'MET' if target['met'] else 'NOT MET'}")
    print(f"  resident floor per rank (0.1M-parameter model): "
          f"{max(results['resident_floor_bytes_per_rank']) / 2**30:.2f} GiB; ZeRO-3's peak above "
          f"it is {target['zero3_peak_memory_above_floor_ratio']:.3f}x ZeRO-0's")
    print(f"  losses of every run agree within {results['loss_max_rel_diff']:.3g} relative "
          f"(tolerance {LOSS_TOLERANCE_FIRST:g} for the first {EXACT_STEPS} steps, "
          f"{LOSS_TOLERANCE:g} later); 1-minute load average before runs: "
          f"{min(results['load_averages']):.1f}-{max(results['load_averages']):.1f}")


def main():
    parser = argparse.ArgumentParser(
        description="tessera-trainer ZeRO 1-3 vs ZeRO-0 on CPU: tokens/s and peak memory/rank.")
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds of all stages")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (processes)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per rank (default 1: two ranks share two cores)")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the shards, tasks and every rank's output")
    args = parser.parse_args()
    if args.runs < 1 or args.threads < 1 or args.ranks < 2:
        parser.error("--runs and --threads must be >= 1, --ranks >= 2")

    found = find_trainer("zero_bench")
    if not found:
        return 2
    build_dir, built = found
    results_dir = os.environ.get(RESULTS_ENV) or os.path.join(build_dir, "bench", "results")

    workdir = tempfile.mkdtemp(prefix="tessera-zero-bench-")
    # Every run uses one copy of the binary, so a rebuild during the benchmark cannot mix builds.
    trainer = os.path.join(workdir, "tessera-trainer")
    shutil.copy2(built, trainer)
    results = {
        "benchmark": "zero",
        "device": "cpu",
        **provenance(built, trainer),
        "config": CONFIG,
        "method": {
            "ranks": args.ranks,
            "threads_per_rank": args.threads,
            "threads_how": "OMP_NUM_THREADS and MKL_NUM_THREADS of every rank",
            "rounds": args.runs,
            "order": "interleaved, each run a fresh set of rank processes: ZeRO 0, 1, 2, 3, "
                     "ZeRO 0, 1, 2, 3, ...",
            "baseline": "ZeRO-0: full replicas, gradients all-reduced per unit during backward "
                        "(as DDP does), AdamW on the whole model on every rank",
            "statistic": "median over runs; ranges are min and max; ratio = median of the stage "
                         "/ median of ZeRO-0; *_by_round divides the i-th runs",
            "timing": "a run's tokens/s = median of rank 0's per-step tokens_per_second "
                      "(global_batch_size * seq_len / step_time_seconds) over the timed steps; "
                      "process start-up, Gloo rendezvous, model construction and the first "
                      "untimed_steps are excluded. tokens_per_second_from_sum = timed tokens / "
                      "sum of timed step times",
            "memory": "per rank: peak resident set of the rank's process (wait4 ru_maxrss: the "
                      "whole process, LibTorch and Gloo included); the ratio compares the "
                      "largest rank of a run. state_mib: what the rank's ShardedEngine holds "
                      "(its log line), without transient gathered units or full gradients on "
                      "the way to a reduce-scatter",
            "equivalence": f"the first {EXACT_STEPS} steps' losses of every run within "
                           f"{LOSS_TOLERANCE_FIRST:g} relative of the first ZeRO-0 run's, every "
                           f"later step's within {LOSS_TOLERANCE:g} (rounding of the sharded "
                           "gradient norm compounds), equal parameter counts; else the "
                           "benchmark fails",
            "data": "data/corpus/kjv-genesis-ruth.txt, byte tokenizer (vocabulary 257), one "
                    "epoch is far more than a run reads",
            "floor": "resident_floor_bytes_per_rank: peak resident set of each rank training "
                     "FLOOR_MODEL (0.1M parameters) at ZeRO-0 with the same ranks and batch, "
                     "once before the rounds; zero3_peak_memory_above_floor_ratio subtracts it "
                     "from both ZeRO-3's and ZeRO-0's median peaks",
            "load": "each run records the 1-minute load average before it started, every rank's "
                    "user and system CPU seconds and minor page faults: other work on the "
                    "machine and kernel time show there",
        },
        "target": {},
        "stages": [],
    }

    def measure():
        shards = prepare_corpus(trainer, workdir, RUN_TIMEOUT_SECONDS)
        tasks = {}
        for stage in STAGES:
            tasks[stage] = os.path.join(workdir, f"zero{stage}.spec.json")
            write_task(tasks[stage], stage, shards, args.ranks)
        print(f"zero_bench: {CONFIG['name']}, {args.ranks} ranks x {args.threads} thread(s), "
              f"{args.runs} rounds of ZeRO {list(STAGES)}, {CONFIG['untimed_steps']} untimed + "
              f"{CONFIG['timed_steps']} timed steps; {results['machine']}", flush=True)
        floor_task = os.path.join(workdir, "floor.spec.json")
        write_task(floor_task, 0, shards, args.ranks, FLOOR_MODEL)
        floor_ranks, _ = launch(trainer, floor_task, args.ranks, args.threads, workdir, "floor")
        results["resident_floor_bytes_per_rank"] = [r["peak_rss_bytes"] for r in floor_ranks]
        print(f"  floor (a 0.1M-parameter model): peak RSS/rank "
              f"{', '.join('%.2f' % (r['peak_rss_bytes'] / 2**30) for r in floor_ranks)} GiB",
              flush=True)
        runs = {stage: [] for stage in STAGES}
        reference = None
        max_diff = 0.0
        for round_index in range(args.runs):
            for stage in STAGES:
                label = f"zero{stage}.round{round_index + 1}"
                ranks, process = launch(trainer, tasks[stage], args.ranks, args.threads,
                                        workdir, label)
                run = summarize_run(stage, ranks, process, label)
                if reference is None:
                    reference = run
                max_diff = max(max_diff, check_same_computation(run, reference, label))
                runs[stage].append(run)
                print(f"  round {round_index + 1} ZeRO-{stage}: {run['tokens_per_second']:6.1f} "
                      f"tokens/s, peak RSS/rank "
                      f"{', '.join('%.2f' % (r['peak_rss_bytes'] / 2**30) for r in run['ranks'])} "
                      f"GiB, state/rank {run['ranks'][0]['state']['total_mib']:.0f} MiB, minor "
                      f"faults/rank {run['ranks'][0]['minor_page_faults']:,} (load average "
                      f"before: {run['load_average_before']:.1f})", flush=True)
        return runs, reference, max_diff

    start = time.perf_counter()
    measured = in_workdir("zero_bench", workdir, args.keep_workdir, measure)
    if measured is None:
        return 1
    runs, reference, max_diff = measured

    results["wall_seconds"] = time.perf_counter() - start
    results["num_parameters"] = reference["num_parameters"]
    results["loss_max_rel_diff"] = max_diff
    results["load_averages"] = [r["load_average_before"] for s in STAGES for r in runs[s]]
    results["stages"] = [summarize_stage(s, runs[s], runs[0]) for s in STAGES]
    zero3 = results["stages"][-1]
    floor = results["resident_floor_bytes_per_rank"]
    results["target"] = {
        **TARGET,
        "zero3_tokens_per_second_ratio": zero3["ratio_tokens_per_second_vs_zero0"],
        "zero3_peak_memory_ratio": zero3["ratio_peak_rss_vs_zero0"],
        "zero3_state_ratio": zero3["ratio_state_bytes_vs_zero0"],
        "zero3_peak_memory_above_floor_ratio":
            (zero3["peak_rss_bytes_max_over_ranks"]["median"] - max(floor)) /
            (results["stages"][0]["peak_rss_bytes_max_over_ranks"]["median"] - max(floor)),
        "met": (zero3["ratio_tokens_per_second_vs_zero0"] >=
                TARGET["zero3_tokens_per_second_ratio_min"] and
                zero3["ratio_peak_rss_vs_zero0"] <= TARGET["zero3_peak_memory_ratio_max"]),
    }
    print_summary(results)
    write_results(results, results_dir, "zero.json", "zero_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
