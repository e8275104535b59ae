"""What the Python benchmarks share: their error type, the provenance they record (commit,
machine) and the median/range summary of repeated runs."""

import json
import os
import statistics
import subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Training text: Genesis to Ruth of the King James Bible (about 1 MiB), tokenized as bytes.
CORPUS = os.path.join(REPO_ROOT, "data", "corpus", "kjv-genesis-ruth.txt")

# Environment set by scripts/bench.sh.
# Directory for the results' JSON.
RESULTS_ENV = "TESSERA_BENCH_RESULTS"
# Git commit of the tree ("-dirty" when modified).
COMMIT_ENV = "TESSERA_BENCH_COMMIT"
# UTC date and time of the bench run (ISO 8601).
DATE_ENV = "TESSERA_BENCH_DATE"
# One line describing CPU, cores, memory and GPUs.
MACHINE_ENV = "TESSERA_BENCH_MACHINE"
# Build directory holding bin/tessera-trainer.
BUILD_DIR_ENV = "TESSERA_BUILD_DIR"

# The multi-process contract of tessera-trainer (common/trainer_env.h), as torchrun sets it.
RANK_ENVS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class BenchError(Exception):
    """A failure that ends the benchmark; its message says what and where."""


def git_commit():
    """The checkout's commit, "-dirty" when tracked files differ from it."""
    try:
        commit = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_line(ask_gpus=True):
    """As scripts/bench.sh describes the machine. Asks nvidia-smi, not torch, for the GPUs so that
    the calling process holds no CUDA context while runs measure memory."""
    cpu = "unknown CPU"
    memory = "unknown RAM"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        memory = f"{mem_kib / 1048576:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    gpus = "none (CPU benchmark)"
    if ask_gpus:
        gpus = "none"
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, check=True).stdout.split("\n")
            gpus = ", ".join(name.strip() for name in names if name.strip()) or "none"
        except (OSError, subprocess.CalledProcessError):
            pass
    return f"{cpu}, {os.cpu_count()} cores, {memory}, GPUs: {gpus}"


def spread(values):
    """Median, extremes and every value of repeated runs."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def write_results(results, results_dir, file_name, bench_name):
    """Writes `results` as JSON to results_dir/file_name and says where."""
    os.makedirs(results_dir, exist_ok=True)
    out = os.path.join(results_dir, file_name)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(f"{bench_name}: {results['wall_seconds']:.0f} s; results in {out}")


def parse_reports(text, what):
    """The trainer's JSON report lines in `text`; BenchError naming `what` for an unreadable line
    or a reported failure."""
    reports = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                reports.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise BenchError(f"{what}: unreadable report line {line[:200]!r}: {e}") from None
    failures = [r["failure"] for r in reports if "failure" in r]
    if failures:
        raise BenchError(f"{what}: reported failure: {json.dumps(failures[0])}")
    return reports
