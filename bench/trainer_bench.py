#!/usr/bin/env python3
"""Trainer throughput benchmark: tessera-trainer against an equivalent PyTorch eager script
(bench/pytorch_baseline.py) training the same model from the same initial weights on the same
samples, with the same optimizer, schedule, precision, batch and thread count.

    python bench/trainer_bench.py --device=cpu    # make bench
    python bench/trainer_bench.py --device=cuda   # make bench-gpu
    python bench/trainer_bench.py --device=cuda --configs=gpt2-124m --baselines=eager,compile

How it runs, per configuration:
  1. `tessera-trainer prepare` tokenizes data/corpus/kjv-genesis-ruth.txt into byte-level shards.
  2. `tessera-trainer --job_spec=S --export_initial=W` writes the weights a fresh run of the job
     spec S starts from; the baseline loads them, so both sides start from identical parameters.
  3. Runs alternate, each a fresh process: ours, PyTorch, ours, PyTorch, ... (--runs of each);
     with --baselines=eager,compile a third side, PyTorch with the model's forward and loss
     through torch.compile (compiled during the untimed steps), follows each PyTorch run.
  4. Both sides report every step's time, measured the same way (from the learning-rate lookup to
     the end of zero_grad, without a device synchronisation at the end). A run's throughput is
     tokens of the timed steps / sum of their step times: process start-up, model building, weight
     loading and each configuration's first untimed_steps (allocator, kernel and data-order
     warm-up) are excluded on both sides alike. On a machine shared with other work, the
     per-run figure from the median step time is the steadier one; both are reported.
  5. The two sides must agree before a figure is believed: equal parameter counts, equal learning
     rates every step, and first-step losses within a tolerance (1e-4 relative in fp32, 2e-3 in
     bf16), in fp32 the losses of every step too; otherwise the benchmark fails.

`--check` times nothing: it trains a tiny GPT-2 and a tiny Qwen3-shaped model once on each side
and compares every step's loss (ctest runs it as trainer_bench.equivalence).

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/trainer.json (trainer-gpu.json for cuda)
with medians, min/max ranges, every run's figures, the configurations, machine, date and commit.
The environment of scripts/bench.sh is optional; missing values fall back to local defaults.
Only the standard library and torch are used.
"""

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import (BUILD_DIR_ENV, COMMIT_ENV, CORPUS, DATE_ENV, MACHINE_ENV, RANK_ENVS,
                          REPO_ROOT, RESULTS_ENV, BenchError, git_commit, machine_line, parse_reports,
                          spread, write_results)

BASELINE = os.path.join(REPO_ROOT, "bench", "pytorch_baseline.py")

# Environment set by scripts/bench.sh.
# Python with the pinned torch wheel (runs the baseline).
PYTHON_ENV = "TESSERA_BENCH_PYTHON"

# Longest one training process may take before the benchmark gives up on it.
RUN_TIMEOUT_SECONDS = {"cpu": 900, "cuda": 1800}
# Largest relative loss difference accepted, by precision. In fp32 both sides run the same ATen
# kernels on the same inputs (observed: 0 at step 1, < 1e-6 later); bf16 autocast on a GPU
# leaves room for other GEMM algorithms and non-deterministic backward kernels, so there only
# the first step is compared. At initialisation the loss is close to ln(vocab_size) whatever
# the batch, so it is the later fp32 steps that would show a different sample order.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-3}
# Learning rates come from the same formula; anything beyond rounding is a schedule mismatch.
LR_TOLERANCE = 1e-9

# Shared by every configuration: the optimizer and schedule of a short pre-training run.
OPTIMIZER = {
    "lr": {"peak": 6e-4, "warmup_steps": 2, "min_lr_ratio": 0.1, "decay_steps": 0},
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "grad_clip": 1.0,
    "seed": 1234,
}

# The CPU configuration is nanoGPT's character-level Shakespeare model (6 layers, width 384, 6
# heads, context 256) with byte tokens: big enough that kernels, not dispatch, dominate, small
# enough that 2 x --runs processes finish in a few minutes on two cores.
CPU_CONFIGS = [
    {
        "name": "gpt2-char-10m",
        "model": {"dims": {"architecture": "ARCHITECTURE_GPT2", "num_layers": 6,
                           "hidden_size": 384, "num_attention_heads": 6, "vocab_size": 257,
                           "max_seq_len": 256, "tie_embeddings": True}},
        "seq_len": 256,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "untimed_steps": 3,
        "timed_steps": 12,
        "precision": "fp32",
    },
    # The same size as a Qwen3-shaped Llama: RMSNorm (with qk_norm), rotary, grouped-query
    # attention (6 heads, 2 kv heads), SwiGLU, untied head.
    {
        "name": "qwen3-char-10m",
        "model": {"dims": {"architecture": "ARCHITECTURE_LLAMA", "num_layers": 6,
                           "hidden_size": 384, "num_attention_heads": 6, "num_kv_heads": 2,
                           "head_dim": 64, "ffn_hidden_size": 1024, "vocab_size": 257,
                           "max_seq_len": 256, "rope_theta": 1e6, "norm_eps": 1e-6,
                           "tie_embeddings": False, "qk_norm": True}},
        "seq_len": 256,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "untimed_steps": 3,
        "timed_steps": 12,
        "precision": "fp32",
    },
    # Host-bound: a model so small (2 layers x 64, seq 64) that a step is mostly dispatch and
    # bookkeeping, as a GPU step of a small model is when the GPU waits on the host. It compares
    # what each side does around the kernels, not the kernels.
    {
        "name": "tiny-gpt2-host",
        "model": {"preset": "tiny-gpt2"},
        "seq_len": 64,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "untimed_steps": 5,
        "timed_steps": 60,
        "precision": "fp32",
    },
]

# GPU configurations: GPT-2 small at its full context, and Qwen3 models of 0.6B (the one `make
# gpu-check` runs) and 1.7B parameters at 2048 tokens (Llama blocks with grouped-query attention, RoPE and qk_norm), both in bf16
# autocast with gradient accumulation. micro_batch_size 1 keeps Qwen3-1.7B (27 GiB of weights,
# gradients and AdamW moments in float32, no activation checkpointing) within an 80 GiB H100.
GPU_CONFIGS = [
    {
        "name": "gpt2-124m",
        "model": {"preset": "gpt2-124m"},
        "seq_len": 1024,
        "global_batch_size": 32,
        "micro_batch_size": 16,
        "untimed_steps": 5,
        "timed_steps": 20,
        "precision": "bf16",
    },
    {
        "name": "qwen3-0.6b",
        "model": {"preset": "qwen3-0.6b"},
        "seq_len": 2048,
        "global_batch_size": 16,
        "micro_batch_size": 4,
        "untimed_steps": 3,
        "timed_steps": 10,
        "precision": "bf16",
    },
    {
        "name": "qwen3-1.7b",
        "model": {"preset": "qwen3-1.7b"},
        "seq_len": 2048,
        "global_batch_size": 16,
        "micro_batch_size": 1,
        "untimed_steps": 3,
        "timed_steps": 10,
        "precision": "bf16",
    },
]

# --check: small models trained for a few steps on each side, whose losses must agree at every
# step. They cover both block types on a machine without a GPU: GPT-2, and a Qwen3-shaped Llama
# (grouped-query attention, qk_norm, head_dim independent of the width, untied output head).
CHECK_CONFIGS = [
    {
        "name": "tiny-gpt2",
        "model": {"preset": "tiny-gpt2"},
        "seq_len": 64,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "untimed_steps": 1,
        "timed_steps": 4,
    },
    {
        "name": "tiny-qwen3",
        "model": {"dims": {"architecture": "ARCHITECTURE_LLAMA", "num_layers": 2,
                           "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
                           "head_dim": 32, "vocab_size": 257, "max_seq_len": 256,
                           "rope_theta": 1e6, "norm_eps": 1e-6, "tie_embeddings": False,
                           "qk_norm": True}},
        "seq_len": 64,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "untimed_steps": 1,
        "timed_steps": 4,
    },
]

def child_env(threads):
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENVS}
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


# --- data and initial weights -----------------------------------------------------------------

def prepare_shards(trainer, env, configs, workdir):
    """Tokenizes the repository's corpus into byte-level shards, repeated as often as needed so
    that no configuration's run reaches the end of an epoch (the baseline recomputes the epoch
    order in Python, which would land in a timed step). Returns the shard glob."""
    tokens_per_copy = os.path.getsize(CORPUS) + 1  # bytes and the end-of-document token
    needed = max((c["untimed_steps"] + c["timed_steps"] + 1) * c["global_batch_size"] *
                 (c["seq_len"] + 1) for c in configs)
    copies = -(-2 * needed // tokens_per_copy)
    shard_dir = os.path.join(workdir, "shards")
    run_checked([trainer, "prepare", "--input=" + ",".join([CORPUS] * copies),
                 f"--output_dir={shard_dir}", "--val_fraction=0"], env,
                RUN_TIMEOUT_SECONDS["cpu"], "tessera-trainer prepare")
    return os.path.join(shard_dir, "train-*.bin")


def run_checked(command, env, timeout, what):
    """Runs command; returns (stdout, process facts: wall and CPU seconds, the 1-minute load
    average before it started). BenchError with the output's tail on failure."""
    load_before = os.getloadavg()[0]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: no result after {timeout} s: {' '.join(command)}") from None
    seconds = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        tail = "\n".join((done.stderr.strip() or done.stdout.strip()).splitlines()[-15:])
        raise BenchError(f"{what} failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
    cpu_seconds = (cpu_after.ru_utime - cpu_before.ru_utime +
                   cpu_after.ru_stime - cpu_before.ru_stime)
    return done.stdout, {"process_seconds": seconds, "process_cpu_seconds": cpu_seconds,
                         "load_average_before": load_before}


# --- one run of each side ---------------------------------------------------------------------


def summarize_run(reports, config, process, what):
    """The figures of one run from its step reports (ours: protobuf JSON, int64 as strings)."""
    started = next((r["started"] for r in reports if "started" in r), None)
    metrics = sorted((r["metrics"] for r in reports if "metrics" in r),
                     key=lambda m: int(m.get("step", 0)))
    steps = config["untimed_steps"] + config["timed_steps"]
    if started is None or [int(m.get("step", 0)) for m in metrics] != list(range(1, steps + 1)):
        raise BenchError(f"{what}: expected a start report and steps 1..{steps}, got "
                         f"{[m.get('step') for m in metrics]}")
    timed = metrics[config["untimed_steps"]:]
    timed_times = [float(m["step_time_seconds"]) for m in timed]
    tokens_per_step = config["global_batch_size"] * config["seq_len"]
    run = {
        "tokens_per_second": tokens_per_step * len(timed) / sum(timed_times),
        "tokens_per_second_median_step": tokens_per_step / statistics.median(timed_times),
        "timed_seconds": sum(timed_times),
        **process,
        "num_parameters": int(started.get("num_parameters", 0)),
        "device": started.get("device", ""),
        "first_step_loss": float(metrics[0].get("loss", 0.0)),
        "final_loss": float(metrics[-1].get("loss", 0.0)),
        "peak_memory_bytes": max(int(m.get("peak_memory_bytes", 0)) for m in metrics),
        "step_time_seconds": [float(m["step_time_seconds"]) for m in metrics],
        "losses": [float(m.get("loss", 0.0)) for m in metrics],
        "learning_rates": [float(m.get("learning_rate", 0.0)) for m in metrics],
    }
    reported_mfu = [float(m["mfu"]) for m in timed if "mfu" in m]
    if reported_mfu:
        run["reported_mfu_median"] = statistics.median(reported_mfu)
    # The trainer's MFU is flops_per_token * tokens/s / peak, with the peak from the planner's
    # device presets (planner/devices.cc): tokens/s over MFU recovers peak / flops_per_token, so
    # both sides' MFU share the trainer's denominator without a second table here.
    per_mfu = [float(m["tokens_per_second"]) / float(m["mfu"]) for m in timed
               if float(m.get("mfu", 0)) > 0 and "tokens_per_second" in m]
    if per_mfu:
        run["tokens_per_second_per_mfu"] = statistics.median(per_mfu)
    if "threads" in started:
        run["threads"] = started["threads"]
    if "startup_seconds" in started:
        run["startup_seconds"] = started["startup_seconds"]
    return run


def run_ours(trainer, spec_args, config, env, timeout, extra_flags=()):
    what = f"{config['name']}: tessera-trainer"
    stdout, process = run_checked([trainer, *spec_args, *extra_flags], env, timeout, what)
    return summarize_run(parse_reports(stdout, what), config, process, what)


def run_pytorch(python, run_config_path, config, env, timeout):
    what = f"{config['name']}: PyTorch baseline"
    stdout, process = run_checked([python, BASELINE, f"--config={run_config_path}"], env, timeout,
                                  what)
    return summarize_run(parse_reports(stdout, what), config, process, what)


# --- configuration files ----------------------------------------------------------------------


def write_spec(path, config, shards, device):
    """The job spec (JSON) of our side, one rank, no checkpoints, no evaluation; returns the
    trainer's arguments that run it."""
    lr = OPTIMIZER["lr"]
    spec = {
        "name": f"trainer-bench-{config['name'].replace('.', '-')}",
        "model": config["model"],
        "data": {"train_shards": shards, "seq_len": config["seq_len"]},
        "batch": {"global_batch_size": config["global_batch_size"],
                  "micro_batch_size": config["micro_batch_size"]},
        "optimizer": {
            "schedule": {"peak_learning_rate": lr["peak"], "warmup_steps": lr["warmup_steps"],
                         "min_lr_ratio": lr["min_lr_ratio"],
                         "decay_steps": lr["decay_steps"]},
            "weight_decay": OPTIMIZER["weight_decay"],
            "beta1": OPTIMIZER["beta1"],
            "beta2": OPTIMIZER["beta2"],
            "epsilon": OPTIMIZER["eps"],
            "grad_clip_norm": OPTIMIZER["grad_clip"],
        },
        "precision": "PRECISION_BF16" if config["precision"] == "bf16" else "PRECISION_FP32",
        "max_steps": config["untimed_steps"] + config["timed_steps"],
        "seed": OPTIMIZER["seed"],
        "resources": {"gpus": 1} if device == "cuda" else {"cpu_slots": 1},
    }
    with open(path, "w") as f:
        json.dump(spec, f, indent=1)
    return [f"--job_spec={path}", *(["--gpu=0"] if device == "cuda" else [])]


def write_baseline_config(path, config, shards, device, init, threads, compile_model=False):
    run_config = dict(OPTIMIZER)
    run_config.update({
        "init": init,
        "train_shards": shards,
        "seq_len": config["seq_len"],
        "global_batch_size": config["global_batch_size"],
        "micro_batch_size": config["micro_batch_size"],
        "steps": config["untimed_steps"] + config["timed_steps"],
        "device": device,
        "precision": config["precision"],
        "threads": threads,
        "compile": compile_model,
    })
    with open(path, "w") as f:
        json.dump(run_config, f, indent=1)


def read_safetensors_metadata(path):
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(header_len)).get("__metadata__", {})


# --- statistics and checks --------------------------------------------------------------------


def check_equivalence(config, ours, theirs, exported_parameters, every_step):
    """Fails loudly unless the two runs trained the same model on the same data: parameter
    counts, learning rates, the first step's loss, and every step's when `every_step`."""
    name = config["name"]
    counts = {"ours": ours["num_parameters"], "pytorch": theirs["num_parameters"],
              "exported_weights": exported_parameters}
    if len(set(counts.values())) != 1:
        raise BenchError(f"{name}: parameter counts differ: {counts}")
    lr_diff = max(abs(a - b) / max(abs(a), 1e-30)
                  for a, b in zip(ours["learning_rates"], theirs["learning_rates"]))
    if lr_diff > LR_TOLERANCE:
        raise BenchError(f"{name}: learning rates differ: ours {ours['learning_rates']} vs "
                         f"PyTorch {theirs['learning_rates']}")
    tolerance = LOSS_TOLERANCE[config["precision"]]
    a, b = ours["first_step_loss"], theirs["first_step_loss"]
    abs_diff = abs(a - b)
    rel_diff = abs_diff / max(abs(a), 1e-30)
    print(f"  {name}: parameters {counts['ours']:,} on both sides; first-step loss ours "
          f"{a:.8f}, PyTorch {b:.8f}, difference {abs_diff:.3g} ({rel_diff:.3g} relative, "
          f"tolerance {tolerance:g})", flush=True)
    if not rel_diff <= tolerance:
        raise BenchError(f"{name}: first-step losses differ beyond {tolerance:g} relative: ours "
                         f"{a!r}, PyTorch {b!r}: the two sides do not train the same model on "
                         f"the same data")
    step_diffs = [abs(x - y) / max(abs(x), 1e-30)
                  for x, y in zip(ours["losses"], theirs["losses"])]
    if every_step:
        print(f"  {name}: losses of {len(step_diffs)} steps agree within {max(step_diffs):.3g} "
              f"relative", flush=True)
        if not max(step_diffs) <= tolerance:
            raise BenchError(f"{name}: losses differ beyond {tolerance:g} relative: ours "
                             f"{ours['losses']}, PyTorch {theirs['losses']}")
    return {
        "num_parameters": counts,
        "first_step_loss": {"ours": a, "pytorch": b, "abs_diff": abs_diff, "rel_diff": rel_diff,
                            "tolerance_rel": tolerance},
        "learning_rates_max_rel_diff": lr_diff,
        "every_step_checked": every_step,
        "loss_max_rel_diff_any_step": max(step_diffs),
        "loss_rel_diff_by_step": step_diffs,
    }


# --- driver -----------------------------------------------------------------------------------


def set_up_config(config, args, paths):
    """Writes both sides' configuration files and the initial weights of `config`; returns the
    trainer arguments of our side (its job spec), the path of the baseline's configuration, and
    the weights' metadata."""
    name, workdir = config["name"], paths["workdir"]
    init_path = os.path.join(workdir, f"{name}.init.safetensors")
    baseline_path = os.path.join(workdir, f"{name}.baseline.json")
    ours = write_spec(os.path.join(workdir, f"{name}.spec.json"), config, paths["shards"],
                      args.device)
    run_checked([paths["trainer"], *ours, f"--export_initial={init_path}"],
                paths["env"], RUN_TIMEOUT_SECONDS[args.device],
                f"{name}: exporting the initial weights")
    write_baseline_config(baseline_path, config, paths["shards"], args.device, init_path,
                          args.threads)
    if "compile" in args.baselines:
        write_baseline_config(baseline_path.replace(".baseline.", ".compiled."), config,
                              paths["shards"], args.device, init_path, args.threads,
                              compile_model=True)
    return ours, baseline_path, read_safetensors_metadata(init_path)


def check_config(config, args, paths):
    """--check: one run of each side; losses must agree at every step."""
    ours_args, baseline_path, metadata = set_up_config(config, args, paths)
    timeout = RUN_TIMEOUT_SECONDS[args.device]
    ours = run_ours(paths["trainer"], ours_args, config, paths["env"], timeout, args.ours_flags)
    theirs = run_pytorch(paths["python"], baseline_path, config, paths["env"], timeout)
    check_equivalence(config, ours, theirs, int(metadata["tessera.num_parameters"]),
                      every_step=True)


def profile_config(config, args, paths):
    """--profile=DIR: one profiled run per side of `config` (3 steps after the untimed ones), the
    Chrome traces in DIR/NAME/ (the torch.compile side's, with --baselines=eager,compile, in
    DIR/NAME/compile/), and bench/profile_summary.py's comparison of ours with each (printed, and
    DIR/NAME/summary.json: [ours, eager] or [ours, eager, compile]). Nothing is timed for the
    results JSON: the profiler slows every side."""
    import profile_summary  # bench/, beside this file

    name = config["name"]
    ours_args, baseline_path, _ = set_up_config(config, args, paths)
    directory = os.path.join(args.profile, name)
    first, count = config["untimed_steps"] + 1, min(3, config["timed_steps"])
    timeout = RUN_TIMEOUT_SECONDS[args.device]
    run_ours(paths["trainer"], ours_args, config, paths["env"], timeout,
             (*args.ours_flags, f"--profile_dir={directory}", f"--profile_steps={first}:{count}"))
    traces = [os.path.join(directory, "trace-rank-0.json")]
    # The baselines, each from its configuration file with the profiler's directory and steps.
    sides = [("eager", baseline_path, directory)]
    if "compile" in args.baselines:
        sides.append(("compile", baseline_path.replace(".baseline.", ".compiled."),
                      os.path.join(directory, "compile")))
    for _, path, side_directory in sides:
        with open(path) as f:
            baseline = json.load(f)
        baseline.update(profile_dir=side_directory, profile_steps=[first, count])
        profiled_path = path.replace(".json", ".profiled.json")
        with open(profiled_path, "w") as f:
            json.dump(baseline, f, indent=1)
        run_pytorch(paths["python"], profiled_path, config, paths["env"], timeout)
        traces.append(os.path.join(side_directory, "trace-pytorch.json"))
    try:
        summaries = [profile_summary.summarize(path, profile_summary.KEPT_TOP) for path in traces]
    except (OSError, ValueError) as e:
        raise BenchError(f"{name}: profile: {e}") from None
    for path, summary in zip(traces, summaries):
        if summary["steps"] != count:
            raise BenchError(f"{name}: {path} holds {summary['steps']} marked steps, not {count}")
    labels = ["ours"] + [("PyTorch eager" if side == "eager" else "torch.compile")
                         for side, _, _ in sides]
    print(f"== {name}: profile of steps {first}..{first + count - 1}, {', then '.join(labels)}")
    for summary in summaries:
        profile_summary.print_summary(summary)
    for summary in summaries[1:]:
        profile_summary.print_comparison(summaries[0], summary)
    with open(os.path.join(directory, "summary.json"), "w") as f:
        json.dump(summaries, f, indent=1)


def bench_config(config, args, paths):
    """Runs one configuration on both sides; returns its JSON section."""
    name, device = config["name"], args.device
    trainer, python, env = paths["trainer"], paths["python"], paths["env"]
    timeout = RUN_TIMEOUT_SECONDS[device]
    ours_args, baseline_path, metadata = set_up_config(config, args, paths)
    dims = json.loads(metadata["tessera.dims"])
    flops_per_token = float(metadata["tessera.flops_per_token"])

    tokens_per_step = config["global_batch_size"] * config["seq_len"]
    print(f"== {name}: {int(metadata['tessera.num_parameters']):,} parameters, seq_len "
          f"{config['seq_len']}, batch {config['global_batch_size']} (micro "
          f"{config['micro_batch_size']}), {config['precision']}, {config['untimed_steps']} "
          f"untimed + {config['timed_steps']} timed steps, {args.runs} runs per side", flush=True)
    ours_runs, theirs_runs, compiled_runs, equivalence = [], [], [], None
    for i in range(args.runs):
        ours = run_ours(trainer, ours_args, config, env, timeout, args.ours_flags)
        ours_runs.append(ours)
        theirs = run_pytorch(python, baseline_path, config, env, timeout)
        theirs_runs.append(theirs)
        compiled_note = ""
        if "compile" in args.baselines:
            compiled = run_pytorch(python, baseline_path.replace(".baseline.", ".compiled."),
                                   config, env, timeout)
            compiled_runs.append(compiled)
            compiled_note = f", torch.compile {compiled['tokens_per_second']:,.0f}"
        print(f"  run {i + 1}/{args.runs}: ours {ours['tokens_per_second']:,.0f} tokens/s, "
              f"PyTorch {theirs['tokens_per_second']:,.0f} tokens/s{compiled_note} (load "
              f"average before: {ours['load_average_before']:.1f}, "
              f"{theirs['load_average_before']:.1f})", flush=True)
        if equivalence is None:
            equivalence = check_equivalence(config, ours, theirs,
                                            int(metadata["tessera.num_parameters"]),
                                            every_step=config["precision"] == "fp32")

    # Every run is deterministic up to the tolerance; a run that strays trained something else.
    tolerance = LOSS_TOLERANCE[config["precision"]]
    reference = ours_runs[0]["first_step_loss"]
    for run in ours_runs + theirs_runs + compiled_runs:
        if not abs(run["first_step_loss"] - reference) <= tolerance * abs(reference):
            raise BenchError(f"{name}: first-step loss {run['first_step_loss']!r} of a later run "
                             f"differs from the first run's {reference!r}")

    peak = (flops_per_token * ours_runs[0]["tokens_per_second_per_mfu"]
            if device == "cuda" and "tokens_per_second_per_mfu" in ours_runs[0] else 0.0)
    sides = {}
    for side, runs in (("ours", ours_runs), ("pytorch", theirs_runs),
                       ("compile", compiled_runs)):
        if not runs:
            continue
        tps = [r["tokens_per_second"] for r in runs]
        section = {
            "tokens_per_second": spread(tps),
            "tokens_per_second_median_step":
                spread([r["tokens_per_second_median_step"] for r in runs]),
            "peak_memory_bytes": spread([r["peak_memory_bytes"] for r in runs]),
            "first_step_loss_by_run": [r["first_step_loss"] for r in runs],
            "runs": runs,
        }
        if peak > 0:
            section["mfu"] = spread([flops_per_token * t / peak for t in tps])
        sides[side] = section
    ratios = [o["tokens_per_second"] / t["tokens_per_second"]
              for o, t in zip(ours_runs, theirs_runs)]
    return {
        "name": name,
        "model": config["model"],
        "resolved_dims": dims,
        "num_parameters": int(metadata["tessera.num_parameters"]),
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
        "seq_len": config["seq_len"],
        "global_batch_size": config["global_batch_size"],
        "micro_batch_size": config["micro_batch_size"],
        "tokens_per_step": tokens_per_step,
        "precision": config["precision"],
        "untimed_steps": config["untimed_steps"],
        "timed_steps": config["timed_steps"],
        "optimizer": OPTIMIZER,
        "ours": sides["ours"],
        "pytorch": sides["pytorch"],
        "ratio_tokens_per_second": (sides["ours"]["tokens_per_second"]["median"] /
                                    sides["pytorch"]["tokens_per_second"]["median"]),
        "ratio_by_run_pair": spread(ratios),
        "ratio_tokens_per_second_median_step":
            (sides["ours"]["tokens_per_second_median_step"]["median"] /
             sides["pytorch"]["tokens_per_second_median_step"]["median"]),
        "equivalence": equivalence,
        **({"compile": {
            **sides["compile"],
            "ratio_tokens_per_second": (sides["ours"]["tokens_per_second"]["median"] /
                                        sides["compile"]["tokens_per_second"]["median"]),
            "ratio_by_run_pair": spread([o["tokens_per_second"] / c["tokens_per_second"]
                                         for o, c in zip(ours_runs, compiled_runs)]),
        }} if compiled_runs else {}),
    }


def print_summary(results):
    print()
    print(f"trainer benchmark ({results['device']}): tokens/s, median [min, max] of "
          f"{results['method']['runs_per_side']} runs per side")
    for c in results["configs"]:
        ours, theirs = c["ours"], c["pytorch"]
        o, t = ours["tokens_per_second"], theirs["tokens_per_second"]
        print(f"  {c['name']}:")
        print(f"    tessera-trainer  {o['median']:>12,.0f}  [{o['min']:,.0f}, {o['max']:,.0f}]")
        print(f"    PyTorch eager    {t['median']:>12,.0f}  [{t['min']:,.0f}, {t['max']:,.0f}]")
        if "compile" in c:
            k = c["compile"]["tokens_per_second"]
            print(f"    torch.compile    {k['median']:>12,.0f}  [{k['min']:,.0f}, {k['max']:,.0f}]")
        r = c["ratio_by_run_pair"]
        print(f"    ratio ours/PyTorch {c['ratio_tokens_per_second']:.3f} (run pairs "
              f"{r['min']:.3f}..{r['max']:.3f}); from median step times "
              f"{c['ratio_tokens_per_second_median_step']:.3f}")
        if "compile" in c:
            print(f"    ratio ours/torch.compile {c['compile']['ratio_tokens_per_second']:.3f}")
        if "mfu" in ours:
            print(f"    MFU ours {ours['mfu']['median']:.1%}, PyTorch "
                  f"{theirs['mfu']['median']:.1%}")
        memory_kind = "peak GPU memory" if results["device"] == "cuda" else "peak RSS"
        print(f"    {memory_kind} ours {ours['peak_memory_bytes']['max'] / 2**30:.2f} GiB, "
              f"PyTorch {theirs['peak_memory_bytes']['max'] / 2**30:.2f} GiB")
        e = c["equivalence"]["first_step_loss"]
        print(f"    first-step loss ours {e['ours']:.8f}, PyTorch {e['pytorch']:.8f} "
              f"(diff {e['abs_diff']:.3g})")


def main():
    parser = argparse.ArgumentParser(
        description="tessera-trainer vs PyTorch eager: tokens/s of the same training run.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--runs", type=int, default=5, help="runs per side (>= 5 for results)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="intra-op threads of both sides (default: the CPUs available)")
    parser.add_argument("--configs", default="",
                        help="comma-separated configuration names (default: all of the device)")
    parser.add_argument("--baselines", default="eager",
                        help="comma-separated: eager (always run), compile (also PyTorch with "
                             "the model's forward and loss through torch.compile)")
    parser.add_argument("--check", action="store_true",
                        help="only check that both sides train the same small models to the "
                             "same losses, once each; no timing, no JSON")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="instead of timing: one run per side under the profiler, Chrome "
                             "traces and a comparison of their kernels in DIR "
                             "(bench/profile_summary.py); with --baselines=eager,compile the "
                             "torch.compile side too")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the shards, tasks and initial weights")
    parser.add_argument("--ours-flag", action="append", default=[], dest="ours_flags",
                        metavar="FLAG",
                        help="a flag for tessera-trainer (repeatable), e.g. --ours-flag=--cuda_graphs")
    args = parser.parse_args()
    if args.runs < 1 or args.threads < 1:
        parser.error("--runs and --threads must be >= 1")
    args.baselines = set(args.baselines.split(","))
    if not args.baselines <= {"eager", "compile"}:
        parser.error(f"--baselines takes eager and compile, not {sorted(args.baselines)}")

    import torch  # after argument parsing, so --help stays fast

    if args.device == "cuda" and not torch.cuda.is_available():
        print("trainer_bench: --device=cuda needs a CUDA GPU, and torch sees none "
              "(torch.cuda.is_available() is False); nothing was measured.", file=sys.stderr)
        return 2

    build_dir = os.environ.get(BUILD_DIR_ENV) or os.path.join(REPO_ROOT, "build")
    trainer = os.path.join(os.path.abspath(build_dir), "bin", "tessera-trainer")
    if not os.access(trainer, os.X_OK):
        print(f"trainer_bench: {trainer} not found; build it (cmake --build {build_dir} --target "
              f"tessera-trainer) or set {BUILD_DIR_ENV}", file=sys.stderr)
        return 2
    python = os.environ.get(PYTHON_ENV) or sys.executable
    results_dir = os.environ.get(RESULTS_ENV) or os.path.join(build_dir, "bench", "results")
    if args.check:
        precision = "bf16" if args.device == "cuda" else "fp32"
        configs = [dict(c, precision=precision) for c in CHECK_CONFIGS]
    else:
        configs = CPU_CONFIGS if args.device == "cpu" else GPU_CONFIGS
    if args.configs:
        wanted = args.configs.split(",")
        unknown = set(wanted) - {c["name"] for c in configs}
        if unknown:
            parser.error(f"unknown --configs {sorted(unknown)}; known for {args.device}: "
                         f"{[c['name'] for c in configs]}")
        configs = [c for c in configs if c["name"] in wanted]

    results = {
        "benchmark": "trainer",
        "device": args.device,
        "commit": os.environ.get(COMMIT_ENV) or git_commit(),
        "date": os.environ.get(DATE_ENV) or
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": os.environ.get(MACHINE_ENV) or machine_line(),
        "python": python,
        "torch_version": torch.__version__,
        "trainer": trainer,
        "ours_flags": args.ours_flags,
        "method": {
            "runs_per_side": args.runs,
            "baselines": sorted(args.baselines),
            "order": "interleaved, each run a fresh process: ours, PyTorch, ours, PyTorch, ...",
            "statistic": "median over runs; ranges are min and max; ratio = median tokens/s of "
                         "ours / median of PyTorch; ratio_by_run_pair divides the i-th runs. "
                         "tokens_per_second_median_step (tokens per step / a run's median "
                         "timed step time) is less sensitive to other load on a shared machine",
            "timing": "each side reports every step's time, from the learning-rate lookup "
                      "through data loading, forward, backward, loss .item(), gradient clipping "
                      "(norm .item()), AdamW and zero_grad, with no device synchronisation at "
                      "the end of a step; a run's tokens/s = global_batch_size * seq_len * "
                      "timed_steps / sum of the timed steps' times. Process start-up, model "
                      "construction, weight loading and the first untimed_steps steps are "
                      "excluded on both sides.",
            "threads": args.threads,
            "threads_how": "OMP_NUM_THREADS and MKL_NUM_THREADS for both processes; "
                           "torch.set_num_threads in the baseline",
            "equivalence": "both sides start from the weights `tessera-trainer "
                           "--export_initial` writes, read the same shards in the trainer's "
                           "order, and must report equal parameter counts, equal learning rates "
                           "and first-step losses within first_step_loss.tolerance_rel (in fp32 "
                           "the losses of every step too), else the benchmark fails",
            "mfu": "flops_per_token (6 * parameters + 12 * layers * hidden * seq_len, as "
                   "planner/model_config.cc, read from the exported weights' metadata) * "
                   "tokens/s / the device's dense bf16 peak (peak_flops: the trainer's, from "
                   "planner/devices.cc, recovered from its reported MFU), the same formula for "
                   "both sides; GPU only",
            "data": "data/corpus/kjv-genesis-ruth.txt, byte tokenizer (vocabulary 257), "
                    "repeated so that a run stays within one epoch",
            "load": "each run records the 1-minute load average before it started and its "
                    "CPU seconds (user + sys): other work on the machine shows there",
            "memory": "cuda: peak allocated bytes of the caching allocator, the maximum over "
                      "steps; cpu: peak resident set of the whole process (for PyTorch it "
                      "includes the Python interpreter and the torch module)",
        },
        "configs": [],
    }

    workdir = tempfile.mkdtemp(prefix="tessera-trainer-bench-")
    start = time.perf_counter()
    try:
        env = child_env(args.threads)
        paths = {"workdir": workdir, "trainer": trainer, "python": python, "env": env,
                 "shards": [prepare_shards(trainer, env, configs, workdir)]}
        if args.check:
            for config in configs:
                check_config(config, args, paths)
            print("trainer_bench: both sides train the same models")
            return 0
        if args.profile:
            args.profile = os.path.abspath(args.profile)
            for config in configs:
                profile_config(config, args, paths)
            return 0
        print(f"trainer_bench: {args.device}, {args.threads} thread(s), {args.runs} runs per "
              f"side; {results['machine']}", flush=True)
        for config in configs:
            results["configs"].append(bench_config(config, args, paths))
    except BenchError as e:
        print(f"trainer_bench: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep_workdir:
            print(f"trainer_bench: work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results["wall_seconds"] = time.perf_counter() - start

    print_summary(results)
    write_results(results, results_dir,
                  "trainer.json" if args.device == "cpu" else "trainer-gpu.json", "trainer_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
