#!/usr/bin/env python3
"""`make gpu-check`: everything Tessera does on a GPU, in one command on a machine with one GPU.
CI has no GPU, so this is where the CUDA paths run at all.

    scripts/gpu_check.py [--build-dir=build] [--out=DIR] [--stages=a,b] [--full]
    scripts/gpu_check.py --cpu-smoke      # the same orchestration on CPU with tiny models

Stages, in order (each runs even when an earlier one failed, except that nothing runs without a
CUDA build; each is timed and recorded):
  environment    nvidia-smi's GPU, torch's version and CUDA, that the binaries are a CUDA build
                 and that every shared library they need resolves (lists the missing ones).
  gpu-tests      the test binaries with GPU cases (GPU_TESTS below), as gtest JSON: passed,
                 failed and skipped per binary; a skipped GPU case counts as a failure here.
  trainer-check  `tessera-trainer --check --gpu=0` (an MLP trained over NCCL).
  cluster        a real coordinator and worker on loopback (the worker finds the GPU through
                 NVML); gpt2-124m (seq 1024) and qwen3-0.6b (seq 2048) trained in bf16 for a few
                 hundred steps through `tessera submit`; per run: tokens/s and MFU (medians after
                 the first tenth of the steps), measured peak GPU memory next to the planner's
                 prediction for the layout it chose, first and last loss, and the NVML series the
                 worker exports on /metrics while the job runs.
  bench          `bench/trainer_bench.py --device=cuda` (what `make bench-gpu` runs) on the same
                 two models: ours vs PyTorch eager and torch.compile, same weights and data;
                 with --full, gpt2-124m again with ours replaying CUDA graphs (--cuda_graphs);
                 then bench/fused_ops_bench: the fused RMSNorm / rotary / SwiGLU / cross-entropy
                 kernels against ATen's composite, forward + backward, per op at two layer
                 shapes.
  profile        one profiled run per side of gpt2-124m (trainer_bench.py --profile; with
                 --full also qwen3-0.6b; --profile-configs picks): kernel time per step by kind
                 and the GPU's busy share; with --profile-compile the torch.compile side too
                 (its compilation included: about 100 s for qwen3-0.6b cold). A stage of its own,
                 so that another model's profile can be taken without the benchmark
                 (--stages=profile --profile-configs=qwen3-0.6b --profile-compile).
  control-plane  bench/control_plane_bench on the machine's cores (GPU machines have many more
                 than the 2 of the project's other machines): a real coordinator against 10,000
                 simulated 8-GPU nodes heartbeating every second, each with its
                 WatchAssignments stream open and announcing task ends at once, as workers
                 run, offered 2,500 jobs/s of 1-2 s;
                 placements/s and heartbeat p50/p99 against the goals (>= 2,000/s,
                 p99 < 20 ms while placing at full rate). A measurement: missing a goal does not
                 fail the stage, an error of the benchmark does.
Results: OUT/gpu-check.json (every figure, with commit, machine and date) and
OUT/gpu-check-summary.md, also printed. Exit 0 when every stage passed, 1 when one failed, 2 when
there is no GPU (or no CUDA build) to check.

Binaries come from --build-dir: a CUDA build of this tree (`make gpu-check` builds one first when
the machine has the Debian packages), or a bundle made on another machine by `make gpu-bundle`
(binaries, GPU test binaries and the shared libraries a machine without a package registry lacks,
in lib/). Torch's own libraries come from the python that holds torch (scripts/bootstrap.sh
--print-python: /opt/torch/.venv on the GPU machines), whichever torch 2.11 build is there.
Standard library only. The default run is meant to fit its 8-minute goal: on one H100 it
took about 7 on 2026-11-26 and 486.5 s on 2026-11-28 (environment 8 s, GPU tests 37 s, cluster
64 s, bench and profile 352 s, control plane 22 s), with one benchmark run per side; the
CUDA-graph run (29 s of that bench) has been --full only since. --full takes longer: two runs per side in the bench,
the CUDA-graph run against eager and torch.compile, five fused-op rounds and longer cluster runs;
about 11-12 minutes by those figures, not yet measured. (--quick, the old name of the default,
is still accepted.)
"""

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
import profile_summary  # noqa: E402
from bench_common import (CORPUS, BenchError, Cluster, git_commit, machine_line,  # noqa: E402
                          tail, utc_now)

STAGES = ("environment", "gpu-tests", "trainer-check", "cluster", "bench", "profile",
          "control-plane")

# Test binaries (under BUILD/tests) with cases that need a GPU, and the cases to run. The CPU
# cases of a binary run too where they are quick: the GPU machine is where their CUDA twins are
# compared with them.
GPU_TESTS = (
    ("model_test", "*"),                  # CUDA vs CPU forward/backward, autocast + recompute
    ("trainer_test", "*"),                # DeviceTest: the trainer runs on the GPU
    ("gpu_inventory_test", "*"),          # the worker's NVML inventory and DCGM-named metrics
    ("trainer_gpu_test", "*Gpu*"),        # bf16 on NCCL vs CPU; ZeRO-3 peak memory vs planner
    ("linear_cross_entropy_test", "*"),   # the chunked head + loss vs linear + cross_entropy
    ("fused_ops_gpu_test", "*"),          # fused RMSNorm / rotary / SwiGLU kernels vs ATen
    ("async_checkpoint_test", "*"),       # a save's copy on its own stream, overlapping a step
    ("deferred_init_test", "*Gpu*"),      # a ZeRO-3 rank allocates its shards, not the model
    ("collective_timer_test", "*Gpu*"),   # collectives timed with CUDA events, never waiting
)
# A skip that is expected on a machine with a GPU: the case checks life without NVML.
EXPECTED_SKIPS = {"GpuInventoryTest.LoadNvmlWithoutNvmlReturnsNullWithReason"}

# Training runs through the cluster. On one H100 (2026-11-26) gpt2-124m took about 0.09 s and
# qwen3-0.6b about 0.5 s a step; the default (short) stage took 62 s with start-up and checks.
CLUSTER_RUNS = (
    {"name": "gpt2-124m", "model": {"preset": "gpt2-124m"}, "seq_len": 1024,
     "global_batch_size": 32, "micro_batch_size": 16, "steps": 200, "quick_steps": 60},
    {"name": "qwen3-0.6b", "model": {"preset": "qwen3-0.6b"}, "seq_len": 2048,
     "global_batch_size": 16, "micro_batch_size": 4, "steps": 120, "quick_steps": 40},
)
SMOKE_RUNS = (
    {"name": "tiny-gpt2", "model": {"preset": "tiny-gpt2"}, "seq_len": 64,
     "global_batch_size": 8, "micro_batch_size": 4, "steps": 12, "quick_steps": 12},
)
BENCH_CONFIGS = "gpt2-124m,qwen3-0.6b"
# Stage time limits (seconds); a stage past its limit fails and the next one runs.
TIMEOUTS = {"gpu-tests": 240, "trainer-check": 120, "cluster-run": 300, "bench": 480,
            "bench-cuda-graphs": 240, "fused-ops-bench": 120, "profile": 180,
            "control-plane": 150}
# The control-plane stage's fleet and load (GPU machine; --cpu-smoke: a small one), and the goals
# its figures are held against.
# The simulated nodes behave as workers do by default: each holds a WatchAssignments stream and
# heartbeats on a notice, and heartbeats at once when a task ends. Until 2026-11-28 they did
# neither here: every order and every end waited for the node's next heartbeat slot, which held
# each job's GPUs ~2.5 s past its run and capped this load at ~1,600 placements/s by free GPUs
# alone, whatever the coordinator did (docs/performance.md).
CONTROL_PLANE = {"nodes": 10000, "jobs_per_s": 2500, "duration_s": 12, "warmup_s": 5,
                 "min_run_time": "1s", "max_run_time": "2s", "watch_assignments": "true",
                 "announce_ends": "true"}
CONTROL_PLANE_SMOKE = {"nodes": 100, "jobs_per_s": 20, "duration_s": 2, "warmup_s": 1,
                       "min_run_time": "1s", "max_run_time": "2s", "watch_assignments": "true",
                       "announce_ends": "true"}
CONTROL_PLANE_GOALS = {"placements_per_s": 2000, "heartbeat_p99_ms": 20}
# The models whose step is profiled on both sides in the profile stage (kernel time by kind), by
# default and with --full (--profile-configs picks others).
PROFILE_CONFIGS = "gpt2-124m"
# The model benchmarked again with --cuda_graphs.
CUDA_GRAPHS_CONFIG = "gpt2-124m"
PROFILE_CONFIGS_FULL = "gpt2-124m,qwen3-0.6b"
# NVML series the worker must export while a GPU job runs (DCGM exporter names).
NVML_SERIES = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE",
               "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_SM_CLOCK")


class StageFailed(Exception):
    """Ends a stage as failed; the message says why."""


# --- environment ------------------------------------------------------------------------------


def bootstrap_python():
    """The python holding torch, as the build uses it (no package is installed from here)."""
    env = dict(os.environ, TESSERA_SKIP_APT="1")
    out = subprocess.run([os.path.join(REPO_ROOT, "scripts", "bootstrap.sh"), "--print-python"],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0 or not out.stdout.strip():
        raise StageFailed(f"scripts/bootstrap.sh --print-python failed: {out.stderr.strip()}")
    return out.stdout.strip().splitlines()[-1]


def torch_facts(python):
    code = ("import json, os, torch; d = torch.cuda.is_available(); print(json.dumps({"
            "'version': torch.__version__, 'cuda': torch.version.cuda, 'cuda_available': d, "
            "'lib_dir': os.path.join(os.path.dirname(torch.__file__), 'lib'), "
            "'site_packages': os.path.dirname(os.path.dirname(torch.__file__)), "
            "'device_name': torch.cuda.get_device_name(0) if d else ''}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise StageFailed(f"{python} cannot import torch: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def library_path(build_dir, torch):
    """Where the binaries' shared libraries are: the bundle's lib/, torch's lib/ and the CUDA
    libraries of the nvidia-* wheels next to it (cuBLAS, cuDNN, NCCL...), then what was set."""
    dirs = [os.path.join(build_dir, "lib"), torch["lib_dir"]]
    dirs += sorted(glob.glob(os.path.join(torch["site_packages"], "nvidia", "*", "lib")))
    dirs += sorted(glob.glob(os.path.join(torch["site_packages"], "nvidia", "cu*", "lib")))
    dirs = [d for d in dirs if os.path.isdir(d)]
    if os.environ.get("LD_LIBRARY_PATH"):
        dirs.append(os.environ["LD_LIBRARY_PATH"])
    return ":".join(dict.fromkeys(dirs))


def nvidia_smi():
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=60)
    gpus = []
    for line in out.stdout.strip().splitlines() if out.returncode == 0 else []:
        name, memory, driver = [part.strip() for part in line.split(",")]
        gpus.append({"name": name, "memory_mib": int(float(memory)), "driver": driver})
    return gpus


def binaries(build_dir):
    found = [os.path.join(build_dir, "bin", b) for b in
             ("tessera", "tessera-coordinator", "tessera-worker", "tessera-trainer")]
    found += [os.path.join(build_dir, "tests", t) for t, _ in GPU_TESTS]
    found += [os.path.join(build_dir, "bench", b) for b in ("fused_ops_bench",
                                                             "control_plane_bench")]
    return found


def stage_environment(ctx):
    facts = {"gpus": nvidia_smi()}
    python = bootstrap_python()
    torch = torch_facts(python)
    facts.update(python=python, torch=torch)
    ctx["python"], ctx["torch"] = python, torch
    ctx["env"]["LD_LIBRARY_PATH"] = library_path(ctx["build_dir"], torch)
    ctx["env"]["TESSERA_BIN_DIR"] = os.path.join(ctx["build_dir"], "bin")
    missing_binaries = [b for b in binaries(ctx["build_dir"])
                        if not os.access(b, os.X_OK) and (ctx["gpu"] or "/tests/" not in b)]
    if missing_binaries:
        raise StageFailed(f"not built: {', '.join(missing_binaries)}")
    ldd = subprocess.run(["ldd", os.path.join(ctx["build_dir"], "bin", "tessera-trainer")],
                         capture_output=True, text=True, env=ctx["env"])
    facts["cuda_build"] = "libtorch_cuda" in ldd.stdout
    missing = set()
    for binary in binaries(ctx["build_dir"]):
        if os.access(binary, os.X_OK):
            out = subprocess.run(["ldd", binary], capture_output=True, text=True, env=ctx["env"])
            missing |= {line.split()[0] for line in out.stdout.splitlines() if "not found" in line}
    facts["missing_libraries"] = sorted(missing)
    ctx["facts"] = facts
    if missing:
        raise StageFailed(f"shared libraries not found: {', '.join(sorted(missing))} (a bundle "
                          f"from `make gpu-bundle` carries them in lib/)")
    if ctx["gpu"]:
        if not facts["cuda_build"]:
            raise StageFailed("bin/tessera-trainer is not a CUDA build (it does not link "
                              "libtorch_cuda): build with WITH_CUDA=ON and a CUDA torch")
        if not torch["cuda_available"]:
            raise StageFailed(f"torch {torch['version']} sees no GPU")
    return facts


# --- GPU tests --------------------------------------------------------------------------------


def stage_gpu_tests(ctx):
    results, failures = [], []
    for binary, gtest_filter in GPU_TESTS:
        path = os.path.join(ctx["build_dir"], "tests", binary)
        report = os.path.join(ctx["workdir"], f"{binary}.gtest.json")
        log = os.path.join(ctx["out"], f"{binary}.log")
        start = time.monotonic()
        with open(log, "w") as f:
            try:
                rc = subprocess.run([path, f"--gtest_filter={gtest_filter}",
                                     f"--gtest_output=json:{report}"], stdout=f,
                                    stderr=subprocess.STDOUT, env=ctx["env"], cwd=REPO_ROOT,
                                    timeout=TIMEOUTS["gpu-tests"]).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        entry = {"binary": binary, "filter": gtest_filter, "exit": rc,
                 "seconds": round(time.monotonic() - start, 1), "passed": [], "failed": [],
                 "skipped": [], "log": log}
        try:
            with open(report) as f:
                suites = json.load(f).get("testsuites", [])
        except (OSError, ValueError):
            suites = []
        for suite in suites:
            for case in suite.get("testsuite", []):
                name = f"{suite['name']}.{case['name']}"
                if case.get("failures"):
                    entry["failed"].append(name)
                elif case.get("result") == "SKIPPED":
                    entry["skipped"].append(name)
                else:
                    entry["passed"].append(name)
        unexpected_skips = [s for s in entry["skipped"] if s not in EXPECTED_SKIPS]
        if rc != 0 or entry["failed"] or unexpected_skips or not entry["passed"]:
            failures.append(f"{binary}: exit {rc}, failed {entry['failed']}, skipped "
                            f"{unexpected_skips} (log {log})")
        results.append(entry)
    if failures:
        raise StageFailed("; ".join(failures), results)
    return results


# --- trainer --check --------------------------------------------------------------------------


def stage_trainer_check(ctx):
    argv = [os.path.join(ctx["build_dir"], "bin", "tessera-trainer"), "--check"]
    if ctx["gpu"]:
        argv.append("--gpu=0")
    out = subprocess.run(argv, capture_output=True, text=True, env=ctx["env"],
                         timeout=TIMEOUTS["trainer-check"])
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise StageFailed(f"{' '.join(argv)} exited {out.returncode}: "
                          f"{(out.stderr or out.stdout).strip()[-800:]}")
    result = json.loads(lines[-1])
    expected = ("cuda", "nccl") if ctx["gpu"] else ("cpu", "gloo")
    if (result.get("device"), result.get("backend")) != expected:
        raise StageFailed(f"--check ran on {result.get('device')}/{result.get('backend')}, "
                          f"expected {expected[0]}/{expected[1]}", result)
    return result


# --- training through a coordinator and a worker ----------------------------------------------


def write_spec(path, run, shards, steps, gpu):
    spec = {
        "name": f"gpu-check-{run['name'].replace('.', '-')}",
        "model": run["model"],
        "data": {"train_shards": [shards], "seq_len": run["seq_len"]},
        "batch": {"global_batch_size": run["global_batch_size"],
                  "micro_batch_size": run["micro_batch_size"]},
        "parallelism": "auto",
        "optimizer": {"schedule": {"peak_learning_rate": 6e-4, "warmup_steps": 20,
                                   "min_lr_ratio": 0.1},
                      "weight_decay": 0.1, "grad_clip_norm": 1.0},
        "precision": "PRECISION_BF16" if gpu else "PRECISION_FP32",
        "max_steps": steps,
        "resources": {"gpus": 1} if gpu else {"cpu_slots": 2},
    }
    with open(path, "w") as f:
        json.dump(spec, f, indent=1)  # JSON is YAML


def scrape(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode(errors="replace")
    except OSError as e:
        return f"# scrape failed: {e}"


def nvml_samples(text):
    """The DCGM-named series' values in a /metrics text: {name: [values]}."""
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(DCGM_FI_DEV_[A-Z_]+)(\{[^}]*\})?\s+(\S+)", line)
        if match:
            samples.setdefault(match.group(1), []).append(float(match.group(3)))
    return samples


def step_figures(points, steps):
    """Medians of tokens/s and MFU over the steps after the first tenth (warm-up), the peak
    memory over all, the first and last loss."""
    points = sorted(points, key=lambda p: int(p.get("step", 0)))
    if [int(p.get("step", 0)) for p in points] != list(range(1, steps + 1)):
        raise StageFailed(f"expected the metrics of steps 1..{steps}, got "
                          f"{len(points)} points")
    steady = points[max(1, steps // 10):]
    return {
        "tokens_per_second": statistics.median(float(p.get("tokens_per_second", 0))
                                               for p in steady),
        "mfu": statistics.median(float(p.get("mfu", 0)) for p in steady),
        "step_seconds": statistics.median(float(p.get("step_time_seconds", 0))
                                          for p in steady),
        "peak_memory_bytes": max(int(p.get("peak_memory_bytes", 0)) for p in points),
        "first_loss": float(points[0].get("loss", 0)),
        "last_loss": float(points[-1].get("loss", 0)),
    }


def train_through_cluster(ctx, cluster, run, shards):
    steps = run["quick_steps"] if ctx["quick"] else run["steps"]
    spec_path = os.path.join(ctx["workdir"], f"{run['name']}.yaml")
    write_spec(spec_path, run, shards, steps, ctx["gpu"])
    job_id = cluster.cli("submit", spec_path).strip()
    start = time.monotonic()
    scraped, job = None, None
    while True:
        if time.monotonic() - start > TIMEOUTS["cluster-run"]:
            raise StageFailed(f"{run['name']}: {job_id} did not finish in "
                              f"{TIMEOUTS['cluster-run']} s (last state "
                              f"{job and job.get('state')}, step {job and job['current_step']})")
        job = cluster.get(job_id)
        if job["state"] in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED"):
            raise StageFailed(f"{run['name']}: {job_id} {job['state']}: {job.get('reason')}\n"
                              f"{cluster.cli('logs', job_id, '--tail=20')}")
        if scraped is None and job["current_step"] >= max(2, steps // 3):
            scraped = scrape(cluster.metrics_url())
        if job["state"] == "JOB_STATE_SUCCEEDED":
            break
        time.sleep(0.5)
    wall = time.monotonic() - start
    points = json.loads(cluster.cli("metrics", job_id, "--format=json", "--max_points=0"))
    if isinstance(points, dict):
        points = points.get("points") or points.get("metrics") or []
    figures = step_figures(points, steps)
    plan = job.get("plan", {})
    predicted = int(plan.get("memory", {}).get("total_bytes", 0))
    result = {
        "name": run["name"], "job_id": job_id, "steps": steps, "seq_len": run["seq_len"],
        "global_batch_size": run["global_batch_size"],
        "micro_batch_size": run["micro_batch_size"], "wall_seconds": round(wall, 1),
        **figures,
        "planned_layout": plan.get("layout", {}),
        "planned_peak_memory_bytes": predicted,
        "planned_tokens_per_second": float(plan.get("step_time", {}).get("tokens_per_second", 0)),
        "peak_memory_measured_over_planned": (figures["peak_memory_bytes"] / predicted
                                              if predicted else None),
        "nvml": nvml_samples(scraped or ""),
    }
    absent = [s for s in NVML_SERIES if s not in result["nvml"]]
    if ctx["gpu"] and absent:
        raise StageFailed(f"{run['name']}: the worker's /metrics lacks {absent} while the job "
                          f"ran", result)
    if not figures["last_loss"] < figures["first_loss"]:
        raise StageFailed(f"{run['name']}: loss did not fall ({figures['first_loss']:.4f} -> "
                          f"{figures['last_loss']:.4f})", result)
    if not (figures["tokens_per_second"] > 0 and figures["peak_memory_bytes"] > 0 and predicted):
        raise StageFailed(f"{run['name']}: no throughput, peak memory or planned memory in the "
                          f"job's metrics and plan", result)
    return result


def stage_cluster(ctx):
    trainer = os.path.join(ctx["build_dir"], "bin", "tessera-trainer")
    shard_dir = os.path.join(ctx["workdir"], "shards")
    subprocess.run([trainer, "prepare", f"--input={CORPUS}", f"--output_dir={shard_dir}",
                    "--val_fraction=0"], check=True, capture_output=True, text=True,
                   env=ctx["env"], timeout=300)
    shards = os.path.join(shard_dir, "train-*.bin")
    # The daemons, and so the trainers, get the library path.
    cluster = Cluster(ctx["build_dir"], ctx["workdir"], metrics=True,
                      cpu_slots=0 if ctx["gpu"] else 2, threads=None if ctx["gpu"] else 1,
                      worker_flags=("--stop_grace=5s",), env=ctx["env"])
    runs, failures = [], []
    try:
        nodes = cluster.cli("--output=json", "nodes")
        for run in (CLUSTER_RUNS if ctx["gpu"] else SMOKE_RUNS):
            try:
                runs.append(train_through_cluster(ctx, cluster, run, shards))
            except StageFailed as e:
                failures.append(str(e.args[0]))
                if len(e.args) > 1:
                    runs.append(e.args[1])
            except BenchError as e:
                failures.append(f"{run['name']}: {e}")
    finally:
        cluster.stop()
        for name in ("coordinator", "worker"):
            shutil.copy(os.path.join(ctx["workdir"], f"{name}.log"),
                        os.path.join(ctx["out"], f"{name}.log"))
    result = {"nodes": json.loads(nodes) if nodes.strip().startswith(("{", "[")) else nodes,
              "runs": runs}
    if failures:
        raise StageFailed("; ".join(failures), result)
    return result


# --- bench-gpu --------------------------------------------------------------------------------


def run_bench_program(ctx, name, argv, env, results_dir, result_file, out_name=None):
    """Runs one benchmark program to completion, its output in OUT/NAME.log; returns the JSON it
    wrote to results_dir/result_file (also copied to OUT, as out_name when given)."""
    log = os.path.join(ctx["out"], f"{name}.log")
    with open(log, "w") as f:
        try:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                timeout=TIMEOUTS[name]).returncode
        except subprocess.TimeoutExpired:
            raise StageFailed(f"{name} did not finish in {TIMEOUTS[name]} s "
                              f"(log {log}):\n{tail(log)}") from None
    if rc != 0:
        raise StageFailed(f"{name} exited {rc} (log {log}):\n{tail(log)}")
    path = os.path.join(results_dir, result_file)
    shutil.copy(path, os.path.join(ctx["out"], out_name or result_file))
    with open(path) as f:
        return json.load(f)


def bench_env(ctx, **extra):
    """The environment of the Python benchmarks: this build's binaries and torch's python."""
    return dict(ctx["env"], TESSERA_BUILD_DIR=ctx["build_dir"], TESSERA_BENCH_PYTHON=ctx["python"],
                PYTHONUNBUFFERED="1", **extra)


def stage_bench(ctx):
    results_dir = os.path.join(ctx["workdir"], "bench")
    os.makedirs(results_dir, exist_ok=True)
    env = bench_env(ctx, TESSERA_BENCH_RESULTS=results_dir)
    bench = run_bench_program(
        ctx, "bench",
        [ctx["python"], os.path.join(REPO_ROOT, "bench", "trainer_bench.py"), "--device=cuda",
         f"--configs={BENCH_CONFIGS}", "--baselines=eager,compile",
         f"--runs={1 if ctx['quick'] else 2}"],
        env, results_dir, "trainer-gpu.json")
    # With --full, ours again with the micro-batches replayed as CUDA graphs (--cuda_graphs),
    # against eager and torch.compile in the same run. Not by default: it took 29 s of the 8
    # minutes for +1.8% / +1.7% (2026-11-26 and -28), and gpu-tests already replays the graphs
    # (GpuCudaGraphsReplayTheEagerSteps). A failure here is reported with the stage's result
    # after the steps below have run.
    graphs_error = None
    if not ctx["quick"]:
        graphs_dir = os.path.join(results_dir, "cuda-graphs")
        os.makedirs(graphs_dir, exist_ok=True)
        try:
            bench["cuda_graphs"] = run_bench_program(
                ctx, "bench-cuda-graphs",
                [ctx["python"], os.path.join(REPO_ROOT, "bench", "trainer_bench.py"),
                 "--device=cuda", f"--configs={CUDA_GRAPHS_CONFIG}", "--baselines=eager,compile",
                 "--runs=1", "--ours-flag=--cuda_graphs"],
                dict(env, TESSERA_BENCH_RESULTS=graphs_dir), graphs_dir, "trainer-gpu.json",
                out_name="trainer-gpu-cuda-graphs.json")
        except (StageFailed, OSError, ValueError) as e:
            graphs_error = f"bench-cuda-graphs: {e.args[0] if e.args else e}"
    # The fused RMSNorm / rotary / SwiGLU kernels against ATen's composite, op by op.
    bench["fused_ops"] = run_bench_program(
        ctx, "fused-ops-bench",
        [os.path.join(ctx["build_dir"], "bench", "fused_ops_bench"),
         f"--rounds={3 if ctx['quick'] else 5}"],
        env, results_dir, "fused-ops.json")
    if graphs_error:
        raise StageFailed(graphs_error, bench)
    return bench


def stage_profile(ctx):
    """One profiled run per side of each profiled config: where the step's GPU time goes, ours
    next to eager's, for the next change to start from (the traces stay in the work directory).
    Returns {config: [ours, eager] summaries}."""
    profile_dir = os.path.join(ctx["workdir"], "profile")
    env = bench_env(ctx)
    profiles = {}
    baselines = "eager,compile" if ctx["profile_compile"] else "eager"
    for config in ctx["profile_configs"]:
        profiles[config] = run_bench_program(
            ctx, "profile",
            [ctx["python"], os.path.join(REPO_ROOT, "bench", "trainer_bench.py"), "--device=cuda",
             f"--configs={config}", f"--profile={profile_dir}", f"--baselines={baselines}"],
            env, os.path.join(profile_dir, config), "summary.json",
            out_name=f"profile-{config}-summary.json")
    return profiles


# --- control plane ----------------------------------------------------------------------------


def process_cpu_seconds():
    """{pid: (name, user + system CPU seconds)} of every process readable in /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (name) state ...": the name may hold spaces and parentheses.
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        found[int(entry)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return found


def machine_busy_seconds():
    """CPU seconds the whole machine has spent busy (all but idle and iowait), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / os.sysconf(
        "SC_CLK_TCK")


def busy_processes(seconds=1.0, threshold=0.05):
    """Over `seconds`: the cores the machine was busy and the processes that used at least
    `threshold` cores (this one excepted; one that started meanwhile counts all it used), as
    (cores, [{"pid", "name", "cores"}] busiest first)."""
    before = process_cpu_seconds()
    machine_before = machine_busy_seconds()
    time.sleep(seconds)
    machine = (machine_busy_seconds() - machine_before) / seconds
    after = process_cpu_seconds()
    busy = []
    for pid, (name, cpu) in after.items():
        cores = (cpu - before.get(pid, (name, 0.0))[1]) / seconds
        if pid != os.getpid() and cores >= threshold:
            busy.append({"pid": pid, "name": name, "cores": round(cores, 2)})
    return machine, sorted(busy, key=lambda p: -p["cores"])


# Busier than this (cores, other processes) and the machine is not quiet enough for the
# control-plane benchmark.
QUIET_CORES = 0.25


def wait_until_quiet(max_seconds=15, max_cores=QUIET_CORES):
    """Waits (up to max_seconds) until the machine is busy under max_cores: the control-plane
    figures are CPU-bound, and the 2026-11-28 run inside the check shared the machine with 0.93
    cores of something else (heartbeat p50 1.03 ms against 0.36 alone). Returns
    {"cores", "processes", "waited_s"} of the last look."""
    start = time.monotonic()
    while True:
        cores, busy = busy_processes()
        if cores < max_cores or time.monotonic() - start >= max_seconds:
            return {"cores": round(cores, 2), "processes": busy,
                    "waited_s": round(time.monotonic() - start, 1)}


def stage_control_plane(ctx):
    load = CONTROL_PLANE if ctx["gpu"] else CONTROL_PLANE_SMOKE
    busy_before = wait_until_quiet() if ctx["gpu"] else None
    results_dir = os.path.join(ctx["workdir"], "control-plane")
    os.makedirs(results_dir, exist_ok=True)
    argv = [os.path.join(ctx["build_dir"], "bench", "control_plane_bench"),
            f"--coordinator={os.path.join(ctx['build_dir'], 'bin', 'tessera-coordinator')}",
            f"--work_dir={ctx['workdir']}", f"--results_dir={results_dir}",
            # The coordinator on its embedded store: this stage times the control plane on the
            # GPU machine's cores; PostgreSQL next to SQLite is `make bench`'s comparison.
            "--backends=sqlite"]
    argv += [f"--{k}={v}" for k, v in load.items()]
    report = run_bench_program(ctx, "control-plane", argv, ctx["env"], results_dir,
                               "control-plane.json")
    scale = report["scales"][0]
    heartbeat = scale["heartbeat_latency"]
    internals = scale.get("coordinator_internals") or {}
    result = {
        "nodes": scale["nodes"], "jobs_offered_per_second": scale["jobs_offered_per_second"],
        "jobs_placed_per_second": scale["jobs_placed_per_second"],
        "heartbeat_p50_ms": heartbeat["p50_ms"], "heartbeat_p99_ms": heartbeat["p99_ms"],
        "heartbeat_p99_ms_windows": scale["heartbeat_p99_ms_windows"],
        "heartbeats_per_second": scale["heartbeats_per_second"],
        "submit_to_all_ranks_delivered_p50_ms":
            scale["submit_to_all_ranks_delivered_latency"]["p50_ms"],
        "coordinator_cores": scale["coordinator_cores"],
        "load_generator_cores": scale["load_generator_cores"],
        "coordinator_peak_rss_mib": scale["coordinator_peak_rss_mib"],
        # The store's single writer: near 1 core, it is what limits placements.
        "store_writer_cores": internals.get("store_writer_cores"),
        "store_cpu_per_write_us": internals.get("store_cpu_per_write_us"),
        # Near 100% allocated with jobs pending: free GPUs, not the coordinator, bound placements.
        "gpus_allocated_share_mean":
            (scale.get("cluster_occupancy") or {}).get("gpus_allocated_share_mean"),
        "pending_jobs_mean": (scale.get("cluster_occupancy") or {}).get("pending_jobs_mean"),
        "bounded_by_free_gpus":
            (scale.get("cluster_occupancy") or {}).get("bounded_by_free_gpus"),
        "machine_cores": os.cpu_count(), "load": load, "goals": CONTROL_PLANE_GOALS,
        # Other processes still busy when the benchmark started (after up to 15 s of waiting).
        "busy_before": busy_before}
    result["goals_met"] = {
        "placements_per_s": result["jobs_placed_per_second"]
        >= CONTROL_PLANE_GOALS["placements_per_s"],
        "heartbeat_p99_ms": result["heartbeat_p99_ms"] < CONTROL_PLANE_GOALS["heartbeat_p99_ms"]}
    if scale["fleet"]["registered"] != scale["nodes"] or scale["jobs"]["first_error"]:
        raise StageFailed(f"the fleet registered {scale['fleet']['registered']} of "
                          f"{scale['nodes']} nodes; first job error: "
                          f"{scale['jobs']['first_error'] or 'none'}", result)
    if result["jobs_placed_per_second"] <= 0:
        raise StageFailed("no job was placed", result)
    return result


# --- driver and report ------------------------------------------------------------------------


def gib(n):
    return f"{n / 2**30:.2f} GiB" if n else "n/a"


def summary_lines(report):
    lines = [f"# GPU check: {report['verdict']}", "",
             f"{report['date']}, commit {report['commit']}, {report['machine']}", ""]
    env = report["stages"].get("environment", {}).get("result") or {}
    if env:
        torch = env.get("torch", {})
        lines.append(f"torch {torch.get('version')} (CUDA {torch.get('cuda')}), GPUs "
                     f"{[g['name'] for g in env.get('gpus', [])] or 'none'}, CUDA build "
                     f"{env.get('cuda_build')}")
        lines.append("")
    lines += ["| stage | result | seconds |", "|---|---|---|"]
    for name, stage in report["stages"].items():
        lines.append(f"| {name} | {stage['status']} | {stage['seconds']:.1f} |")
    for name, stage in report["stages"].items():
        if stage.get("error"):
            lines += ["", f"**{name} failed:** {stage['error']}"]
    tests = report["stages"].get("gpu-tests", {}).get("result") or []
    if tests:
        lines += ["", "| test binary | passed | failed | skipped |", "|---|---|---|---|"]
        for t in tests:
            lines.append(f"| {t['binary']} ({t['filter']}) | {len(t['passed'])} | "
                         f"{len(t['failed'])} | {len(t['skipped'])} |")
    cluster = report["stages"].get("cluster", {}).get("result") or {}
    if cluster.get("runs"):
        lines += ["", "| run (through coordinator + worker) | steps | tokens/s | MFU | peak memory "
                  "(planner) | loss first -> last |", "|---|---|---|---|---|---|"]
        for r in cluster["runs"]:
            if "tokens_per_second" not in r:
                continue
            lines.append(f"| {r['name']} seq {r['seq_len']}, batch {r['global_batch_size']} | "
                         f"{r['steps']} | {r['tokens_per_second']:,.0f} | {r['mfu']:.1%} | "
                         f"{gib(r['peak_memory_bytes'])} ({gib(r['planned_peak_memory_bytes'])}) "
                         f"| {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    bench = report["stages"].get("bench", {}).get("result") or {}
    for label, section in (("bench", bench), ("bench with --cuda_graphs",
                                               bench.get("cuda_graphs") or {})):
        for c in section.get("configs", []):
            line = (f"{label} {c['name']}: ours {c['ours']['tokens_per_second']['median']:,.0f} "
                    f"tokens/s, {c['ratio_tokens_per_second']:.3f}x PyTorch eager")
            if "compile" in c:
                line += (f", {c['compile']['ratio_tokens_per_second']:.3f}x torch.compile")
            lines += ["", line]
    for config, profile in (report["stages"].get("profile", {}).get("result") or {}).items():
        # [ours, eager] or [ours, eager, compile] (--profile-compile).
        if len(profile) not in (2, 3) or not profile_summary.kernel_rows(*profile[:2]):
            continue
        names = ["ours", "PyTorch eager", "torch.compile"][:len(profile)]
        table = {}  # kind -> ms per step of each side
        for i, other in enumerate(profile[1:], start=1):
            for kind, x, y in profile_summary.kernel_rows(profile[0], other):
                row = table.setdefault(kind, [0.0] * len(profile))
                row[0], row[i] = x, y
        lines += ["", f"| profile {config}, kernel ms per step | " + " | ".join(names) + " |",
                  "|---" * (len(profile) + 1) + "|"]
        lines += [f"| {kind} | " + " | ".join(f"{v:.2f}" for v in row) + " |"
                  for kind, row in table.items() if kind != "total"]
        lines.append("| total | " + " | ".join(f"{v:.2f}" for v in table["total"]) + " |")
        lines.append("| GPU busy share | " + " | ".join(f"{p['gpu_busy_share']:.0%}"
                                                       for p in profile) + " |")
    fused = bench.get("fused_ops", {}).get("results", [])
    if fused:
        lines += ["", "| fused kernel (forward + backward, bf16) | fused | ATen composite | "
                  "speedup |", "|---|---|---|---|"]
        for r in fused:
            lines.append(f"| {r['shape']}: {r['op']} | {1e6 * r['fused_seconds']:.1f} us | "
                         f"{1e6 * r['composite_seconds']:.1f} us | {r['speedup']:.2f}x |")
    control = report["stages"].get("control-plane", {}).get("result") or {}
    if control:
        met = control["goals_met"]
        lines += ["", f"control plane ({control['nodes']:,} nodes, "
                  f"{control['jobs_offered_per_second']:,.0f} jobs/s offered, "
                  f"{control['machine_cores']} cores): {control['jobs_placed_per_second']:,.0f} "
                  f"placed/s (goal >= {control['goals']['placements_per_s']:,}: "
                  f"{'met' if met['placements_per_s'] else 'not met'}), heartbeat p50 / p99 "
                  f"{control['heartbeat_p50_ms']:.1f} / {control['heartbeat_p99_ms']:.1f} ms "
                  f"(goal p99 < {control['goals']['heartbeat_p99_ms']} ms: "
                  f"{'met' if met['heartbeat_p99_ms'] else 'not met'}), coordinator "
                  f"{control['coordinator_cores']:.2f} cores"]
        if control.get("store_writer_cores") is not None:
            lines[-1] += (f", the store's writer {control['store_writer_cores']:.2f} cores "
                          f"({control['store_cpu_per_write_us']:.0f} us a write)")
        if control.get("gpus_allocated_share_mean") is not None:
            lines[-1] += (f"; GPUs allocated {100 * control['gpus_allocated_share_mean']:.0f}% "
                          f"and {control['pending_jobs_mean']:.0f} jobs pending (means)")
            if control.get("bounded_by_free_gpus"):
                lines[-1] += ": placements were bounded by free GPUs, not by the coordinator"
        busy = control.get("busy_before") or {}
        if busy.get("cores", 0) >= QUIET_CORES:
            lines += ["", f"the machine was still {busy['cores']:.2f} cores busy when the "
                      f"control-plane benchmark started (after {busy['waited_s']:.0f} s of "
                      "waiting): " + (", ".join(f"{p['name']} (pid {p['pid']}) {p['cores']:.2f}"
                                                for p in busy["processes"][:5]) or "short-lived")]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", default=os.path.join(REPO_ROOT, "build"))
    parser.add_argument("--out", default="", help="results directory (default BUILD/gpu-check)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {', '.join(STAGES)}")
    parser.add_argument("--full", action="store_true",
                        help="more steps and benchmark runs (two per side), torch.compile beside "
                             "the CUDA-graph run: about 11-12 minutes instead of 7")
    parser.add_argument("--quick", action="store_true",
                        help="the default (kept so that older command lines still run)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: the same orchestration on CPU with a tiny model (what "
                             "`make test` runs so that this script keeps working)")
    parser.add_argument("--profile-configs", default="", metavar="A,B",
                        help=f"the models profiled in the profile stage (default {PROFILE_CONFIGS}; "
                             f"with --full {PROFILE_CONFIGS_FULL})")
    parser.add_argument("--profile-compile", action="store_true",
                        help="the profile stage profiles the torch.compile side too")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args()
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    if args.cpu_smoke:
        stages = [s for s in stages if s not in ("gpu-tests", "bench", "profile")]
    build_dir = os.path.abspath(args.build_dir)
    out = os.path.abspath(args.out or os.path.join(build_dir, "gpu-check"))
    os.makedirs(out, exist_ok=True)
    gpu = not args.cpu_smoke
    if gpu and not nvidia_smi():
        print("gpu-check: nvidia-smi finds no GPU on this machine; nothing to check (run it on a "
              "machine with one; --cpu-smoke checks this script on CPU)", file=sys.stderr)
        return 2

    workdir = tempfile.mkdtemp(prefix="tessera-gpu-check.")
    if args.full and args.quick:
        parser.error("--full and --quick contradict each other")
    quick = not args.full
    profile_configs = args.profile_configs or (PROFILE_CONFIGS if quick else PROFILE_CONFIGS_FULL)
    ctx = {"build_dir": build_dir, "out": out, "workdir": workdir, "gpu": gpu,
           "quick": quick, "env": dict(os.environ),
           "profile_configs": [c for c in profile_configs.split(",") if c],
           "profile_compile": args.profile_compile}
    report = {"date": utc_now(), "commit": git_commit(), "machine": machine_line(),
              "build_dir": build_dir, "mode": "gpu" if gpu else "cpu-smoke",
              "quick": quick, "stages": {}}
    runners = {"environment": stage_environment, "gpu-tests": stage_gpu_tests,
               "trainer-check": stage_trainer_check, "cluster": stage_cluster,
               "bench": stage_bench, "profile": stage_profile,
               "control-plane": stage_control_plane}
    if "environment" not in stages:
        stages.insert(0, "environment")  # every stage needs its library path
    for name in stages:
        print(f"gpu-check: {name} ...", flush=True)
        start = time.monotonic()
        entry = {"status": "passed"}
        try:
            entry["result"] = runners[name](ctx)
        except StageFailed as e:
            entry.update(status="failed", error=e.args[0],
                         result=e.args[1] if len(e.args) > 1 else None)
        except (BenchError, OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
            entry.update(status="failed", error=f"{type(e).__name__}: {e}")
        entry["seconds"] = time.monotonic() - start
        report["stages"][name] = entry
        print(f"gpu-check: {name} {entry['status']} in {entry['seconds']:.1f} s"
              + (f": {entry['error']}" if entry.get("error") else ""), flush=True)
        failed = [n for n, s in report["stages"].items() if s["status"] != "passed"]
        report["verdict"] = "passed" if not failed else f"FAILED ({', '.join(failed)})"
        # Written after every stage, so that a check cut short keeps what it measured.
        with open(os.path.join(out, "gpu-check.json"), "w") as f:
            json.dump(report, f, indent=1)
        if name == "environment" and entry["status"] == "failed":
            break  # without binaries, libraries and a GPU nothing else can run
    lines = summary_lines(report)
    with open(os.path.join(out, "gpu-check-summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"gpu-check: results in {out}/gpu-check.json and gpu-check-summary.md")
    if args.keep_workdir or failed:
        print(f"gpu-check: work directory kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
