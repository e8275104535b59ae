#!/usr/bin/env python3
"""Coordinator failover benchmark: how long clients wait for a new leader after the leading
coordinator is killed (docs/coordinator.md "High availability"; goal < 10 s).

    python bench/failover_bench.py       # make bench BENCH=failover

How it runs:
  1. A private PostgreSQL cluster (initdb + pg_ctl as an unprivileged user, `nobody` when run as
     root) on a free loopback port, in a temporary directory, as tests/postgres_fixture.h starts
     one; fsync stays on (the store's commits wait for it, as in production).
  2. Coordinators with --state=postgresql://... and the default lease (5 s) and standby poll
     (1 s), as an operator runs them: the first leads; each run starts one more as the standby.
  3. Each run: once the standby serves (and the leader has accepted a job), SIGKILL the leader,
     then submit a job to the standby through the `tessera` CLI every POLL_SECONDS until one is
     accepted. Measured: from the kill until that submission returned (the lease expiring, the
     standby's poll, its takeover, loading the state, starting the servers, and the job's
     first write). The standby of one run is the leader of the next.

Scheduling onto workers needs workers that follow the leader (--coordinator with several
addresses); this measures serving.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/failover.json (median, min, max, every
run, the configuration, machine, date and commit). Only the standard library is used.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench_common import (RESULTS_ENV, BenchError, free_port, git_commit, machine_line, spread,
                          tail, utc_now, write_results)

BENCH = "failover"
RUNS = 10
LEASE_SECONDS = 5
POLL_SECONDS = 0.05
GOAL_SECONDS = 10
PG_BIN_ENV = "TESSERA_PG_BIN"
PG_BIN_DEFAULT = "/usr/lib/postgresql/15/bin"


class Postgres:
    """A private PostgreSQL server in `workdir`; url() names its database."""

    def __init__(self, workdir):
        self.bin = os.environ.get(PG_BIN_ENV) or PG_BIN_DEFAULT
        if not os.access(os.path.join(self.bin, "initdb"), os.X_OK):
            raise BenchError(f"PostgreSQL server binaries not found in {self.bin} (install "
                             f"Debian's postgresql, or set {PG_BIN_ENV})")
        self.dir = os.path.join(workdir, "pg")
        os.makedirs(self.dir)
        self.as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "nobody")
            os.chmod(self.dir, 0o700)
        self._run([os.path.join(self.bin, "initdb"), "-D", f"{self.dir}/data", "-U", "tessera",
                   "--auth=trust", "--no-locale", "-E", "UTF8"], "initdb")
        self.port = free_port()
        self._run([os.path.join(self.bin, "pg_ctl"), "-D", f"{self.dir}/data", "-l",
                   f"{self.dir}/server.log", "-w", "-t", "60", "-o",
                   f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start"],
                  "pg_ctl start")
        self._run([os.path.join(self.bin, "createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                   "-U", "tessera", "tessera"], "createdb")

    def _run(self, argv, what):
        out = subprocess.run(self.as_user + argv, capture_output=True, text=True)
        if out.returncode != 0:
            raise BenchError(f"{what} failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")

    def url(self):
        return f"postgresql://tessera@127.0.0.1:{self.port}/tessera"

    def stop(self):
        subprocess.run(self.as_user + [os.path.join(self.bin, "pg_ctl"), "-D",
                                       f"{self.dir}/data", "-m", "immediate", "-w", "stop"],
                       capture_output=True)


class Coordinator:
    def __init__(self, bin_dir, workdir, name, url):
        self.log_path = os.path.join(workdir, f"{name}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [os.path.join(bin_dir, "tessera-coordinator"), "--listen=127.0.0.1:0",
                 "--metrics_listen=", f"--state={url}", f"--leader_lease_seconds={LEASE_SECONDS}",
                 "--max_submits_per_minute=0", f"--checkpoint_root={workdir}/ckpt"],
                stdout=log, stderr=subprocess.STDOUT)
        self.address = self.wait_for(r"standby serving gRPC on (\S+:\d+)")

    def wait_for(self, pattern, seconds=60):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with open(self.log_path) as f:
                match = re.search(pattern, f.read())
            if match:
                return match.group(1) if match.groups() else match.group(0)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise BenchError(f"coordinator did not log {pattern!r}:\n{tail(self.log_path)}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def submit(cli, address, spec_path, timeout=10):
    """The job id, or None when the coordinator did not accept it."""
    out = subprocess.run([cli, f"--coordinator={address}", "submit", spec_path],
                         capture_output=True, text=True, timeout=timeout)
    return out.stdout.strip() if out.returncode == 0 else None


def measure(bin_dir, workdir, runs):
    postgres = Postgres(workdir)
    coordinators = []
    try:
        spec_path = os.path.join(workdir, "job.json")
        with open(spec_path, "w") as f:
            json.dump({"name": "failover", "model": {"preset": "tiny-gpt2"},
                       "data": {"train_shards": ["/data/train-*.bin"], "seq_len": 64},
                       "batch": {"global_batch_size": 8, "micro_batch_size": 2},
                       "optimizer": {"schedule": {"peak_learning_rate": 1e-3}},
                       "max_steps": 100, "resources": {"cpu_slots": 2}}, f)  # JSON is YAML
        cli = os.path.join(bin_dir, "tessera")
        leader = Coordinator(bin_dir, workdir, "coordinator-0", postgres.url())
        coordinators.append(leader)
        leader.wait_for(r"leading with epoch 1 ")
        leader.wait_for(r"coordinator: serving gRPC on")
        seconds = []
        for run in range(runs):
            standby = Coordinator(bin_dir, workdir, f"coordinator-{run + 1}", postgres.url())
            coordinators.append(standby)
            if submit(cli, leader.address, spec_path) is None:
                raise BenchError(f"run {run}: the leader {leader.address} refused a job:\n"
                                 f"{tail(leader.log_path)}")
            killed = time.monotonic()
            leader.proc.kill()
            leader.proc.wait()
            while submit(cli, standby.address, spec_path) is None:
                if time.monotonic() - killed > 60:
                    raise BenchError(f"run {run}: no new leader after 60 s:\n"
                                     f"{tail(standby.log_path)}")
                if standby.proc.poll() is not None:
                    raise BenchError(f"run {run}: the standby exited:\n{tail(standby.log_path)}")
                time.sleep(POLL_SECONDS)
            seconds.append(round(time.monotonic() - killed, 3))
            print(f"{BENCH}: run {run + 1}/{runs}: {seconds[-1]:.2f} s from kill -9 to the "
                  f"standby accepting a job", flush=True)
            leader = standby
        return seconds
    finally:
        for coordinator in coordinators:
            coordinator.stop()
        postgres.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--keep_workdir", action="store_true")
    args = parser.parse_args()
    build_dir = os.environ.get("TESSERA_BUILD_DIR", "build")
    bin_dir = os.path.join(build_dir, "bin")
    for binary in ("tessera-coordinator", "tessera"):
        if not os.access(os.path.join(bin_dir, binary), os.X_OK):
            raise BenchError(f"{bin_dir}/{binary} not built (ninja -C {build_dir} {binary})")
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="tessera-failover-bench-")
    os.chmod(workdir, 0o755)  # the server's user (nobody) reaches its directory through it
    try:
        seconds = measure(bin_dir, workdir, args.runs)
    finally:
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    figures = spread(seconds)
    results = {
        "bench": BENCH,
        "date": os.environ.get("TESSERA_BENCH_DATE") or utc_now(),
        "commit": os.environ.get("TESSERA_BENCH_COMMIT") or git_commit(),
        "machine": os.environ.get("TESSERA_BENCH_MACHINE") or machine_line(ask_gpus=False),
        "config": {"runs": args.runs, "leader_lease_seconds": LEASE_SECONDS,
                   "standby_poll_seconds": 1, "client_poll_seconds": POLL_SECONDS},
        "failover_seconds": figures,
        "goal_seconds": GOAL_SECONDS,
        "wall_seconds": time.monotonic() - started,
    }
    print(f"{BENCH}: kill -9 of the leader to the standby accepting a job: median "
          f"{figures['median']:.2f} s, max {figures['max']:.2f} s over {args.runs} runs "
          f"(goal < {GOAL_SECONDS} s)")
    write_results(results, os.environ.get(RESULTS_ENV, "bench-results"), f"{BENCH}.json", BENCH)
    return 0 if figures["max"] < GOAL_SECONDS else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"{BENCH}: {e}", file=sys.stderr)
        sys.exit(1)
