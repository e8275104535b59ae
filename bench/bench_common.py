"""What the Python benchmarks share: their error type, the provenance they record (commit,
machine) and the median/range summary of repeated runs; and for the multi-process CPU benchmarks
(bench/zero_bench.py, bench/model_parallel_bench.py) the launch of a job's ranks as torchrun
would, its task file and the checks that runs computed the same thing; and a local cluster (a real
coordinator and worker driven through the CLI) for bench/fault_bench.py, bench/peermem_bench.py
and scripts/gpu_check.py, with the restart benchmarks' settings, job spec and rank lookup.
Standard library only."""

import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
import trainer_spec  # noqa: E402
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


# --- the multi-process CPU benchmarks ---------------------------------------------------------

# Longest one run (all its ranks) may take before the benchmark gives up on it.
RUN_TIMEOUT_SECONDS = 600


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_trainer(bench_name):
    """The build directory and its bin/tessera-trainer ($TESSERA_BUILD_DIR, else ./build), or
    None, having said on stderr what is missing."""
    build_dir = os.environ.get(BUILD_DIR_ENV) or os.path.join(REPO_ROOT, "build")
    built = os.path.join(os.path.abspath(build_dir), "bin", "tessera-trainer")
    if not os.access(built, os.X_OK):
        print(f"{bench_name}: {built} not found; build it (cmake --build {build_dir} "
              f"--target tessera-trainer) or set {BUILD_DIR_ENV}", file=sys.stderr)
        return None
    return build_dir, built


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def provenance(built, trainer):
    """Commit, date and machine (scripts/bench.sh's, else found here) and the trainer binary:
    `built`, run through its copy `trainer`."""
    return {
        "commit": os.environ.get(COMMIT_ENV) or git_commit(),
        "date": os.environ.get(DATE_ENV) or utc_now(),
        "machine": os.environ.get(MACHINE_ENV) or machine_line(ask_gpus=False),
        "trainer": built,
        "trainer_sha256": sha256_of(trainer),
        "trainer_mtime": datetime.datetime.fromtimestamp(
            os.path.getmtime(built), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def prepare_corpus(trainer, workdir, timeout):
    """Tokenizes CORPUS into byte-level shards under workdir; returns the shards' glob."""
    shard_dir = os.path.join(workdir, "shards")
    subprocess.run([trainer, "prepare", f"--input={CORPUS}", f"--output_dir={shard_dir}",
                    "--val_fraction=0"], check=True, capture_output=True, text=True,
                   cwd=REPO_ROOT, timeout=timeout)
    return os.path.join(shard_dir, "train-*.bin")


def write_cpu_spec(path, prefix, job, config, shards, layout, world, model=None):
    """The job spec (JSON, which --job_spec reads as YAML) of one job of `world` CPU ranks:
    `config`'s model (or `model`), batch, optimizer, seed and untimed + timed steps, fp32, with
    the explicit layout `layout` (degrees it leaves out completed: trainer_spec.completed); named
    "prefix-job". The trainer plans it as the coordinator would a submission."""
    spec = trainer_spec.completed({
        "name": re.sub(r"[^a-z0-9-]", "-", f"{prefix}-{job}".lower()),
        "model": model or config["model"],
        "data": {"train_shards": [shards], "seq_len": config["seq_len"]},
        "batch": {"global_batch_size": config["global_batch_size"],
                  "micro_batch_size": config["micro_batch_size"]},
        "optimizer": config["optimizer"],
        "precision": "PRECISION_FP32",
        "max_steps": config["untimed_steps"] + config["timed_steps"],
        "seed": config["seed"],
        "parallelism": {"layout": layout},
    }, world)
    with open(path, "w") as f:
        json.dump(spec, f, indent=1)


def free_port():
    """A port free now on 127.0.0.1 for the rendezvous (the usual bind-to-0 race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(threads, rank, world, port):
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENVS}
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)})
    return env


def tail(path, lines=15):
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().strip().splitlines()[-lines:])
    except OSError:
        return ""


def run_ranks(trainer, spec_path, world, threads, workdir, label, timeout, poll_seconds,
              on_poll=None, args=()):
    """Starts `world` ranks of the job spec at spec_path (write_cpu_spec) and waits for all of them, looking every poll_seconds.
    Returns the 1-minute load average before the launch and, per rank, a dict: rank, the paths of
    its stdout and stderr (out, err), what the kernel counted for its process (rusage, from
    wait4) and when its end was seen (seconds after the launch). on_poll(seconds, ranks), when
    given, is called at every look before the ranks are waited on; a rank's dict has "rusage"
    once it has ended, "popen" throughout, and keeps what on_poll stores in it. BenchError with
    the failing rank's output on a failure, or after `timeout` seconds (the other ranks are
    killed: they would wait on the dead one). `args`: more trainer flags, for every rank."""
    port = free_port()
    load_before = os.getloadavg()[0]
    procs = []
    try:
        for rank in range(world):
            out = os.path.join(workdir, f"{label}.rank{rank}.out")
            err = os.path.join(workdir, f"{label}.rank{rank}.err")
            with open(out, "w") as out_f, open(err, "w") as err_f:
                procs.append({"rank": rank, "out": out, "err": err, "popen": subprocess.Popen(
                    [trainer, f"--job_spec={spec_path}", *args], stdout=out_f, stderr=err_f,
                    env=rank_env(threads, rank, world, port), cwd=REPO_ROOT)})
        start = time.perf_counter()
        while any("rusage" not in p for p in procs):
            now = time.perf_counter() - start
            if on_poll:
                on_poll(now, procs)
            for p in procs:
                if "rusage" in p:
                    continue
                pid, status, usage = os.wait4(p["popen"].pid, os.WNOHANG)
                if pid != 0:
                    p["popen"].returncode = os.waitstatus_to_exitcode(status)
                    p["rusage"] = usage
                    p["seconds"] = now
            failed = [p for p in procs if p.get("rusage") and p["popen"].returncode != 0]
            if failed:
                p = failed[0]
                raise BenchError(f"{label}: rank {p['rank']} failed (exit "
                                 f"{p['popen'].returncode}):\n{tail(p['err']) or tail(p['out'])}")
            if now > timeout:
                raise BenchError(f"{label}: no result after {timeout} s:\n"
                                 f"{tail(procs[0]['err'])}")
            time.sleep(poll_seconds)
    finally:
        for p in procs:
            if "rusage" not in p and p["popen"].poll() is None:
                p["popen"].send_signal(signal.SIGKILL)
                p["popen"].wait()
    return procs, load_before


class Cluster:
    """A real coordinator and one real worker on loopback (state and work under `workdir`),
    driven through the `tessera` CLI as a user would; stop() ends them.

    cpu_slots: the worker's CPU trainer slots (0: its GPUs, found through NVML, are the slots).
    metrics: serve both daemons' /metrics on free ports (metrics_url() names the worker's).
    threads: OMP/MKL threads of the daemons' environment, inherited by the trainers (None: the
    worker's own choice, cores divided by slots).
    env: the daemons' environment (default this process's), which the trainers inherit."""

    def __init__(self, build_dir, workdir, coordinator_flags=(), worker_flags=(), cpu_slots=0,
                 metrics=False, threads=None, env=None):
        self.bin = os.path.join(build_dir, "bin")
        self.workdir = workdir
        self.procs = []
        self.env = dict(os.environ if env is None else env)
        if threads is not None:
            self.env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        metrics_listen = "--metrics_listen=127.0.0.1:0" if metrics else "--metrics_listen="
        coordinator = self._start("coordinator", [
            os.path.join(self.bin, "tessera-coordinator"), "--listen=127.0.0.1:0", metrics_listen,
            f"--state={workdir}/state.db", f"--checkpoint_root={workdir}/ckpt",
            f"--master_port_base={30000 + os.getpid() % 1000 * 20}", *coordinator_flags])
        self.address = self._wait_for(coordinator, r"serving gRPC on (\S+:\d+)")
        worker = self._start("worker", [
            os.path.join(self.bin, "tessera-worker"), f"--coordinator={self.address}",
            "--listen=127.0.0.1:0", metrics_listen, "--node_name=bench-node",
            f"--cpu_slots={cpu_slots}", f"--work_dir={workdir}/worker", *worker_flags])
        self._wait_for(worker, r"registered with")
        self.worker_metrics_port = (
            self._wait_for(worker, r"metrics on port (\d+)") if metrics else None)

    def _start(self, name, argv):
        log = open(os.path.join(self.workdir, f"{name}.log"), "w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        proc.log_path = log.name
        self.procs.append(proc)
        return proc

    @staticmethod
    def _wait_for(proc, pattern, seconds=30):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with open(proc.log_path) as f:
                match = re.search(pattern, f.read())
            if match:
                return match.group(1) if match.groups() else match.group(0)
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise BenchError(f"{proc.args[0]} did not log {pattern!r}:\n{tail(proc.log_path)}")

    def cli(self, *args, timeout=60):
        out = subprocess.run([os.path.join(self.bin, "tessera"), f"--coordinator={self.address}",
                              *args], capture_output=True, text=True, timeout=timeout,
                             env=self.env)
        if out.returncode != 0:
            raise BenchError(f"tessera {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def get(self, job_id):
        job = json.loads(self.cli("--output=json", "get", job_id))
        job["current_step"] = int(job.get("current_step", 0))
        job["restarts"] = int(job.get("restarts", 0))
        return job

    def metrics_url(self):
        return f"http://127.0.0.1:{self.worker_metrics_port}/metrics"

    def stop(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def restart_cluster(build_dir, workdir, worker_flags=()):
    """The cluster of the restart benchmarks (bench/fault_bench.py, bench/peermem_bench.py): a
    heartbeat every 500 ms and a node lost after 5 s, so that a killed rank is noticed quickly;
    one worker with two CPU slots whose trainers run one thread each and get 2 s to stop."""
    return Cluster(build_dir, workdir,
                   coordinator_flags=("--heartbeat_interval=500ms", "--heartbeat_timeout=5s"),
                   cpu_slots=2, worker_flags=("--stop_grace=2s", *worker_flags), threads=1)


def write_job_spec(path, name, model, shards, seq_len, global_batch, micro_batch,
                   peak_learning_rate, warmup_steps, steps, checkpoint_interval, keep_last,
                   max_restarts):
    """Writes a two-slot fp32 CPU job spec to `path` (JSON, which is YAML); `model` is the spec's
    model section ({"preset": ...} or {"dims": ...})."""
    spec = {
        "name": name,
        "model": model,
        "data": {"train_shards": [shards], "seq_len": seq_len},
        "batch": {"global_batch_size": global_batch, "micro_batch_size": micro_batch},
        "optimizer": {"schedule": {"peak_learning_rate": peak_learning_rate,
                                   "warmup_steps": warmup_steps}},
        "precision": "PRECISION_FP32",
        "max_steps": steps,
        "checkpoint": {"interval_steps": checkpoint_interval, "keep_last": keep_last},
        "resources": {"cpu_slots": 2},
        "max_restarts": max_restarts,
    }
    with open(path, "w") as f:
        json.dump(spec, f)


def rank_pid(workdir, job_id, attempt, rank):
    """The pid of a rank's trainer under a Cluster's worker (found by its task file), or None
    while there is not exactly one."""
    task = f"{workdir}/worker/jobs/{job_id}/attempt-{attempt}/rank-{rank}.task.pb"
    out = subprocess.run(["pgrep", "-f", "--", f"--task={task}"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    return pids[0] if len(pids) == 1 else None


def json_lines(path, what):
    with open(path, errors="replace") as f:
        return parse_reports(f.read(), what)


def step_reports(rank, steps, what):
    """The start report and the step metrics 1..steps (in order) in a rank's output; BenchError
    unless all are there."""
    reports = json_lines(rank["out"], what) + json_lines(rank["err"], what)
    started = next((r["started"] for r in reports if "started" in r), None)
    metrics = sorted((r["metrics"] for r in reports if "metrics" in r),
                     key=lambda m: int(m.get("step", 0)))
    if started is None or [int(m.get("step", 0)) for m in metrics] != list(range(1, steps + 1)):
        raise BenchError(f"{what}: expected a start report and steps 1..{steps} from rank 0, got "
                         f"{[m.get('step') for m in metrics]}")
    return started, metrics


def loss_diffs(run, reference, what, reference_name, compared, exact_steps, tolerance_first,
               tolerance):
    """Fails unless `run` trained the same model on the same data as `reference` (the first
    `reference_name` run): equal parameter counts, the first `exact_steps` losses within
    tolerance_first relative of the reference's, the later ones within `tolerance`. Returns the
    relative loss differences by step."""
    if run["num_parameters"] != reference["num_parameters"]:
        raise BenchError(f"{what}: {run['num_parameters']} parameters, the reference run "
                         f"{reference['num_parameters']}")
    diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(run["losses"], reference["losses"])]
    if (len(diffs) != len(reference["losses"]) or
            not max(diffs[:exact_steps]) <= tolerance_first or not max(diffs) <= tolerance):
        first = "at the first step" if exact_steps == 1 else f"in the first {exact_steps} steps"
        raise BenchError(f"{what}: losses {run['losses']} differ from the first {reference_name} "
                         f"run's {reference['losses']} beyond {tolerance_first:g} relative {first} "
                         f"or {tolerance:g} later (by step: {['%.3g' % d for d in diffs]}): the "
                         f"{compared} do not compute the same thing")
    return diffs


def in_workdir(bench_name, workdir, keep_workdir, measure):
    """Returns measure()'s result, then removes workdir unless keep_workdir. On a BenchError or a
    failed or hung subprocess says so on stderr, keeps workdir and returns None."""
    try:
        return measure()
    except (BenchError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else ""
        print(f"{bench_name}: FAILED: {e}\n{detail or ''}".rstrip(), file=sys.stderr)
        keep_workdir = True
        return None
    finally:
        if keep_workdir:
            print(f"{bench_name}: work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# --- one-process runs from a Hugging Face model against PyTorch (moe_bench, lora_bench) -------


def run_init_from(trainer, config, model_dir, shards, job, extra_spec=None, timeout=900):
    """One tessera-trainer run, from --set settings, of the save_pretrained model in model_dir:
    config's untimed + timed steps of batch x seq_len in one micro-batch, AdamW (lr, weight decay
    0.1, clip 1.0, cosine to 0.1 of lr), with extra_spec's fields (e.g. lora) added. Returns its
    step times and the largest peak memory it reported (peak RSS on CPU)."""
    steps = config["untimed_steps"] + config["timed_steps"]
    spec = {"name": job, "model": {"from_pretrained": model_dir},
            "data": {"train_shards": [shards], "seq_len": config["seq_len"]},
            "batch": {"global_batch_size": config["batch"], "micro_batch_size": config["batch"]},
            "optimizer": {"schedule": {"peak_learning_rate": config["lr"], "warmup_steps": 1,
                                       "min_lr_ratio": 0.1},
                          "weight_decay": 0.1, "grad_clip_norm": 1.0},
            "max_steps": steps, **(extra_spec or {})}
    args = [trainer, *trainer_spec.spec_args(spec)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise BenchError(f"{job}: tessera-trainer failed:\n{result.stderr[-2000:]}")
    metrics = [r["metrics"] for r in parse_reports(result.stdout, job) if "metrics" in r]
    return {"step_times": [float(m["step_time_seconds"]) for m in metrics],
            "peak_rss_bytes": max(int(m.get("peak_memory_bytes", 0)) for m in metrics)}


def timed_tokens_per_second(run, config):
    """Tokens of a run's timed steps (after config's untimed ones) over their summed time."""
    timed = run["step_times"][config["untimed_steps"]:]
    return config["batch"] * config["seq_len"] * len(timed) / sum(timed)


def report_sides(bench_name, config, figures, ratios_of, trainer, started):
    """Prints each side's median tokens/s and peak RSS over its runs (figures: side -> runs) and
    the ratios ratios_of(medians) names, and writes them with every run's spread to
    $TESSERA_BENCH_RESULTS/<bench_name>.json (else build/bench/results)."""
    medians = {side: statistics.median(r["tokens_per_second"] for r in runs)
               for side, runs in figures.items()}
    memory = {side: statistics.median(r["peak_rss_bytes"] for r in runs)
              for side, runs in figures.items()}
    ratios = ratios_of(medians)
    print(f"{bench_name}: median tokens/s: " +
          ", ".join(f"{s} {medians[s]:.0f}" for s in figures))
    print(f"{bench_name}: median peak RSS MiB: " +
          ", ".join(f"{s} {memory[s] / 2**20:.0f}" for s in figures))
    for name, value in ratios.items():
        print(f"{bench_name}: {name} = {value:.3f}")
    results = {
        "benchmark": bench_name, "config": config, "ratios": ratios,
        "tokens_per_second": {s: spread([r["tokens_per_second"] for r in runs])
                              for s, runs in figures.items()},
        "peak_rss_bytes": {s: spread([r["peak_rss_bytes"] for r in runs])
                           for s, runs in figures.items()},
        "wall_seconds": time.time() - started,
        **provenance(trainer, trainer),
    }
    results_dir = os.environ.get(RESULTS_ENV) or os.path.join(REPO_ROOT, "build", "bench",
                                                              "results")
    write_results(results, results_dir, f"{bench_name}.json", bench_name)
