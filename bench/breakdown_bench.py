#!/usr/bin/env python3
"""What the step time breakdown costs: tessera-trainer data parallel on CPU with the breakdown on
(--step_breakdown, the default: phases timed, every collective timed by kind and dimension, a
rank_step report per rank per step) against the same job with it off, in the same run.

    python bench/breakdown_bench.py        # make bench BENCH=breakdown

How it runs: `tessera-trainer prepare` tokenizes the repository's corpus; one job (a small GPT-2
of 4 layers of width 256 with a byte vocabulary, fp32, --ranks processes over Gloo with
--threads intra-op threads each) runs --runs times with the breakdown on and --runs times with
it off, alternating, each a fresh set of processes. A run's figure is the median of rank 0's step
times over its timed steps (the first untimed steps excluded); each side's figure is the median
over its runs, and the ratio is on / off (goal: < 1.01). Both sides must compute the same losses
(the breakdown only measures), and the on side must carry a breakdown in its reports and the off
side none, or the benchmark fails.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/breakdown.json.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench_common import (RESULTS_ENV, RUN_TIMEOUT_SECONDS, BenchError, find_trainer, in_workdir,
                          json_lines, prepare_corpus, provenance, run_ranks, spread, step_reports,
                          write_cpu_spec, write_results)

CONFIG = {
    "name": "gpt2-4x256-byte",
    "model": {"dims": {"architecture": "ARCHITECTURE_GPT2", "num_layers": 4, "hidden_size": 256,
                       "num_attention_heads": 8, "vocab_size": 257, "max_seq_len": 128,
                       "tie_embeddings": True}},
    "seq_len": 128,
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "untimed_steps": 3,
    "timed_steps": 20,
    "seed": 11,
    "optimizer": {"schedule": {"peak_learning_rate": 3e-4, "warmup_steps": 2,
                               "min_lr_ratio": 0.1, "decay_steps": 0},
                  "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8,
                  "grad_clip_norm": 1.0},
}
SIDES = {"on": "--step_breakdown=true", "off": "--step_breakdown=false"}
GOAL_RATIO_MAX = 1.01


def one_run(trainer, task, ranks, threads, workdir, side, index):
    label = f"{side}-{index}"
    procs, load_before = run_ranks(trainer, task, ranks, threads, workdir, label,
                                   RUN_TIMEOUT_SECONDS, 0.2, args=(SIDES[side],))
    steps = CONFIG["untimed_steps"] + CONFIG["timed_steps"]
    _, metrics = step_reports(procs[0], steps, label)
    timed = metrics[CONFIG["untimed_steps"]:]
    with_breakdown = sum(1 for p in procs for r in json_lines(p["out"], label)
                         if "rank_step" in r and r["rank_step"].get("breakdown"))
    return {"side": side, "load_before": load_before,
            "median_step_seconds": statistics.median(float(m["step_time_seconds"]) for m in timed),
            "losses": [float(m["loss"]) for m in metrics],
            "rank_step_reports_with_breakdown": with_breakdown}


def measure(args, built, trainer, workdir):
    started = time.perf_counter()
    # Every run uses one copy of the binary, so a rebuild during the benchmark cannot mix builds.
    shutil.copy2(built, trainer)
    shards = prepare_corpus(trainer, workdir, RUN_TIMEOUT_SECONDS)
    task = os.path.join(workdir, "spec.json")
    write_cpu_spec(task, "breakdown", "job", CONFIG, shards,
                   {"data_parallel": args.ranks, "tensor_parallel": 1, "pipeline_parallel": 1},
                   args.ranks)
    runs = []
    for index in range(args.runs):
        for side in SIDES:
            run = one_run(trainer, task, args.ranks, args.threads, workdir, side, index)
            runs.append(run)
            print(f"breakdown: {side} run {index + 1}: median step "
                  f"{run['median_step_seconds']:.4f} s (load {run['load_before']:.1f})")
    reference = runs[0]["losses"]
    for run in runs:
        if run["losses"] != reference:
            raise BenchError(f"{run['side']}: losses {run['losses']} differ from {reference}: "
                             "the breakdown changed what is computed")
        expected = run["side"] == "on"
        if (run["rank_step_reports_with_breakdown"] > 0) != expected:
            raise BenchError(f"{run['side']}: {run['rank_step_reports_with_breakdown']} rank_step "
                             "reports carry a breakdown")
    medians = {side: statistics.median(r["median_step_seconds"] for r in runs
                                       if r["side"] == side) for side in SIDES}
    ratio = medians["on"] / medians["off"]
    by_side = {side: spread([r["median_step_seconds"] for r in runs if r["side"] == side])
               for side in SIDES}
    for side, figures in by_side.items():
        print(f"breakdown: {side}: median step {figures['median']:.4f} s "
              f"(runs {figures['min']:.4f} to {figures['max']:.4f} s)")
    print(f"breakdown: on/off {ratio:.4f} (goal < {GOAL_RATIO_MAX})")
    return {"benchmark": "breakdown", "device": "cpu", "config": CONFIG, "ranks": args.ranks,
            "threads": args.threads, "step_seconds": by_side, "on_off_ratio": ratio,
            "goal_ratio_max": GOAL_RATIO_MAX, "runs": runs,
            "wall_seconds": time.perf_counter() - started, **provenance(built, trainer)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per side, alternating")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (processes)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args()
    if args.runs < 1 or args.ranks < 2 or args.threads < 1:
        parser.error("--runs and --threads must be >= 1, --ranks >= 2")
    found = find_trainer("breakdown")
    if not found:
        return 2
    build_dir, built = found
    workdir = tempfile.mkdtemp(prefix="tessera-breakdown-bench-")
    trainer = os.path.join(workdir, "tessera-trainer")
    results = in_workdir("breakdown", workdir, args.keep_workdir,
                         lambda: measure(args, built, trainer, workdir))
    if results is None:
        return 1
    results_dir = os.environ.get(RESULTS_ENV) or os.path.join(build_dir, "bench", "results")
    write_results(results, results_dir, "breakdown.json", "breakdown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
