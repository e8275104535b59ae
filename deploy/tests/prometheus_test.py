#!/usr/bin/env python3
"""The dashboards and alert rules against a real Prometheus server and a real cluster.

Starts a coordinator (one queue in a queue file) and two workers (tessera binaries from --bin_dir)
on loopback, a Prometheus server (Debian's) scraping them every second with deploy's alert rules
loaded, trains one job on CPU and one whose loss turns NaN (TESSERA_FAULT_NAN_LOSS_AT_STEP on its
worker), then:
  - runs every query of every dashboard panel through Prometheus' HTTP API: each must return
    data. Every series of the metrics contract the CPU daemons export (REAL_SERIES: per-rank
    phase and collective counters, progress counters, the coordinator's step and checkpoint
    timestamps, leadership) must come from the real coordinator and workers: nothing stands in
    for them, so a daemon that stopped exporting one fails the test. Only what needs a GPU
    comes from two labelled stand-in targets, and the output says which: "dcgm-exporter"
    (DCGM-named series of two synthetic GPUs) and "tessera-synthetic" (tessera_task_gpu_info,
    tessera_gpu_xid_errors_total);
  - waits for the NaN-loss and failed-job alerts to fire.
Prints "N passed, N failed, N skipped" and exits 0 when nothing failed, 77 (skipped) when
Prometheus or the binaries are missing. Every process it starts is stopped at the end.
"""
import argparse
import http.server
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

DEPLOY = pathlib.Path(__file__).resolve().parent.parent
DASHBOARDS = DEPLOY / "helm" / "tessera" / "files" / "dashboards"
RULES = DEPLOY / "helm" / "tessera" / "files" / "alerts.rules.yaml"
SKIP = 77


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, work, bin_dir):
        self.work = work
        self.bin = bin_dir
        self.processes = []

    def start(self, name, argv, env=None):
        log = open(self.work / f"{name}.log", "w")
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        self.processes.append(process)
        return process

    def wait_for_line(self, name, pattern, timeout=60):
        deadline = time.time() + timeout
        path = self.work / f"{name}.log"
        while time.time() < deadline:
            match = re.search(pattern, path.read_text()) if path.exists() else None
            if match:
                return match
            time.sleep(0.1)
        raise RuntimeError(f"{name}: '{pattern}' not in its log within {timeout}s:\n"
                           + (path.read_text() if path.exists() else ""))

    def stop(self):
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.time() + 15
        for process in reversed(self.processes):
            try:
                process.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# The series of the metrics contract (docs/observability.md) the dashboards read. Those the CPU
# daemons export must come from them: each must have data from a real target (a worker built
# without one fails the test), and nothing stands in for it.
REAL_SERIES = (
    "tessera_train_phase_seconds_total", "tessera_train_collective_seconds_total",
    "tessera_train_collective_bytes_total", "tessera_train_rank_steps_total",
    "tessera_train_steps_total", "tessera_train_tokens_total", "tessera_train_samples_total",
    "tessera_train_max_steps", "tessera_job_last_step_timestamp_seconds",
    "tessera_job_last_checkpoint_timestamp_seconds", "tessera_job_running",
    "tessera_coordinator_leader", "tessera_coordinator_leader_epoch",
)

GPU_UUIDS = ("GPU-synthetic-0", "GPU-synthetic-1")


def gpu_series(job_id):
    """The series only a GPU gives (none here), for the labelled stand-in target
    "tessera-synthetic": what a worker with two GPUs exports for the training job's ranks.
    {name: (type, [(labels, value of the elapsed seconds)])}."""
    const = lambda value: (lambda elapsed: value)  # noqa: E731
    return {
        "tessera_task_gpu_info": ("gauge", [
            ({"job_id": job_id, "rank": str(i), "node": "worker-a", "gpu": str(i), "UUID": uuid},
             const(1)) for i, uuid in enumerate(GPU_UUIDS)]),
        "tessera_gpu_xid_errors_total": ("counter", [
            ({"gpu": str(i), "UUID": uuid, "Hostname": "worker-a"}, const(0))
            for i, uuid in enumerate(GPU_UUIDS)]),
    }


def dcgm_series():
    """What dcgm-exporter would export for two idle-ish GPUs."""
    values = {"DCGM_FI_DEV_GPU_UTIL": 87, "DCGM_FI_DEV_MEM_COPY_UTIL": 30,
              "DCGM_FI_DEV_FB_USED": 61000, "DCGM_FI_DEV_FB_FREE": 20000,
              "DCGM_FI_DEV_POWER_USAGE": 550.5, "DCGM_FI_DEV_GPU_TEMP": 64,
              "DCGM_FI_DEV_SM_CLOCK": 1980, "DCGM_FI_DEV_XID_ERRORS": 0,
              "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0}
    series = {name: ("gauge", [({"gpu": str(i), "UUID": uuid, "Hostname": "worker-a"},
                                lambda elapsed, v=v: v) for i, uuid in enumerate(GPU_UUIDS)])
              for name, v in values.items()}
    for name in ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"):
        series[name] = ("counter", [({"gpu": str(i), "UUID": uuid, "Hostname": "worker-a"},
                                     lambda elapsed: 0) for i, uuid in enumerate(GPU_UUIDS)])
    return series


class SyntheticTarget:
    """An HTTP server answering /<path> with the series set for it (Prometheus' text format)."""

    def __init__(self):
        self.series = {}
        self.start = time.time()
        target = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = target.exposition(self.path.strip("/")).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def exposition(self, path):
        elapsed = time.time() - self.start
        lines = []
        for name, (kind, samples) in sorted(self.series.get(path, {}).items()):
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                lines.append(f"{name}{{{text}}} {value(elapsed)}")
        return "\n".join(lines) + "\n"

    def stop(self):
        self.server.shutdown()


def http_json(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def query(prometheus, expr):
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return http_json(url)
    except urllib.error.HTTPError as error:  # a bad query answers 400 with a JSON body
        return json.loads(error.read())


def cli(args, bin_dir, coordinator):
    out = subprocess.run([f"{bin_dir}/tessera", f"--coordinator={coordinator}", *args],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"tessera {' '.join(args)}: {out.stdout}{out.stderr}")
    return out.stdout


def job_state(bin_dir, coordinator, job_id):
    got = json.loads(cli(["get", job_id, "--output=json"], bin_dir, coordinator))
    return got.get("state", ""), int(got.get("current_step", 0) or 0)


def spec(name, data, steps, slots, selector, extra=""):
    return (f"name: {name}\nmodel: {{preset: tiny-gpt2}}\n"
            f"data: {{train_shards: ['{data}/train-*.bin'], validation_shards: ['{data}/val-*.bin'],"
            f" seq_len: 64, eval_interval_steps: 20, eval_batches: 2}}\n"
            f"batch: {{global_batch_size: 8, micro_batch_size: 2}}\n"
            f"optimizer: {{schedule: {{peak_learning_rate: 3e-3, warmup_steps: 5}}}}\n"
            f"max_steps: {steps}\n"
            f"resources: {{cpu_slots: {slots}, node_selector: {{fault: {selector}}}}}\n{extra}")


def panel_queries():
    """(dashboard, panel title, expr) of every panel target."""
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                yield path.stem, panel["title"], target["expr"]


def substitute(expr, job_id):
    # Job ids are [a-z0-9-], nothing a regular expression treats specially. The GPU panels read
    # the stand-in dcgm-exporter (what metrics.gpuSource=dcgm selects).
    values = {"job_id": job_id, "Hostname": ".*", "gpu": ".*", "job": "dcgm-exporter",
              # What Grafana computes for a 1-hour view at 1 s scrapes: a window that spans this
              # whole test, so every histogram has observations in it.
              "__rate_interval": "1m", "__range": "10m", "__interval": "15s"}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin_dir", required=True)
    parser.add_argument("--prometheus", default="/usr/bin/prometheus")
    parser.add_argument("--corpus", required=True)
    args = parser.parse_args()
    if not args.prometheus or not os.access(args.prometheus, os.X_OK):
        print(f"skipped: no Prometheus server at '{args.prometheus}'")
        return SKIP
    for binary in ("tessera", "tessera-coordinator", "tessera-worker", "tessera-trainer"):
        if not os.access(f"{args.bin_dir}/{binary}", os.X_OK):
            print(f"skipped: {args.bin_dir}/{binary} is not built")
            return SKIP

    passed, failed, skipped = [], [], []
    work = pathlib.Path(tempfile.mkdtemp(prefix="tessera-prometheus-test."))
    cluster = Cluster(work, args.bin_dir)
    synthetic = SyntheticTarget()
    try:
        subprocess.run([f"{args.bin_dir}/tessera-trainer", "prepare", f"--input={args.corpus}",
                        f"--output_dir={work}/data"], check=True, capture_output=True, timeout=120)
        # One queue holding both workers' slots: the Queues row's series exist (only with a
        # queue file), and both jobs are admitted as before.
        (work / "queues.yaml").write_text(
            "queues:\n  - name: research\n    nominal: {cpu_slots: 3}\ndefault_queue: research\n")
        cluster.start("coordinator", [
            f"{args.bin_dir}/tessera-coordinator", "--listen=127.0.0.1:0",
            "--metrics-listen=127.0.0.1:0", f"--state={work}/state.db",
            f"--checkpoint-root={work}/checkpoints", f"--master-port-base={free_port()}",
            "--heartbeat-interval=500ms", "--heartbeat-timeout=5s", "--failure-settle=2s",
            f"--queue-file={work}/queues.yaml", "--topology-levels=rack"])
        match = cluster.wait_for_line("coordinator", r"serving gRPC on (\S+:\d+), metrics on port (\d+)")
        coordinator, coordinator_metrics = match.group(1), int(match.group(2))
        worker_metrics = []
        for name, label, env in (("worker-a", "none", {}),
                                 ("worker-b", "nan", {"TESSERA_FAULT_NAN_LOSS_AT_STEP": "5"})):
            cluster.start(name, [
                f"{args.bin_dir}/tessera-worker", f"--coordinator={coordinator}",
                "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0", f"--node-name={name}",
                "--cpu-slots=2" if name == "worker-a" else "--cpu-slots=1",
                f"--labels=fault={label}", f"--work-dir={work}/{name}", "--stop-grace=2s",
                f"--topology=rack=r-{name}"], env)
            worker_metrics.append(int(cluster.wait_for_line(
                name, r"metrics on port (\d+)").group(1)))
            cluster.wait_for_line(name, "registered with")

        prometheus = f"127.0.0.1:{free_port()}"
        (work / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "tessera-coordinator",
                 "static_configs": [{"targets": [f"127.0.0.1:{coordinator_metrics}"]}]},
                {"job_name": "tessera-worker",
                 "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in worker_metrics]}]},
                {"job_name": "tessera-synthetic", "metrics_path": "/tessera",
                 "static_configs": [{"targets": [synthetic.address]}]},
                {"job_name": "dcgm-exporter", "metrics_path": "/dcgm",
                 "static_configs": [{"targets": [synthetic.address]}]},
            ]}))
        cluster.start("prometheus", [
            args.prometheus, f"--config.file={work}/prometheus.yml",
            f"--storage.tsdb.path={work}/tsdb", f"--web.listen-address={prometheus}"])
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://{prometheus}/-/ready", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.3)
        # Every target scraped once before any job exists: a histogram whose first sample already
        # holds the jobs' observations never increases, and its quantiles read NaN.
        deadline = time.time() + 30
        while True:
            targets = http_json(f"http://{prometheus}/api/v1/targets")["data"]["activeTargets"]
            if len(targets) == 5 and all(t["health"] == "up" for t in targets):
                break
            if time.time() > deadline:
                raise RuntimeError(f"Prometheus targets not all up: {targets}")
            time.sleep(0.3)

        # Checkpoints every 20 steps: the coordinator's last-checkpoint series is a real one.
        (work / "train.yaml").write_text(spec("observed", work / "data", 1000000, 2, "none",
                                              "checkpoint: {interval_steps: 20}\n"))
        (work / "nan.yaml").write_text(spec("diverges", work / "data", 50, 1, "nan",
                                            "max_restarts: 1\n"))
        training = cli(["submit", str(work / "train.yaml")], args.bin_dir, coordinator).split()[0]
        diverging = cli(["submit", str(work / "nan.yaml")], args.bin_dir, coordinator).split()[0]

        # The observed job past its first evaluations, the diverging one failed after a restart.
        deadline = time.time() + 120
        while True:
            state, step = job_state(args.bin_dir, coordinator, training)
            nan_state, _ = job_state(args.bin_dir, coordinator, diverging)
            if state == "JOB_STATE_RUNNING" and step >= 60 and nan_state == "JOB_STATE_FAILED":
                break
            if time.time() > deadline:
                raise RuntimeError(f"{training} {state} at step {step}; {diverging} {nan_state}")
            time.sleep(0.5)

        # Every series the CPU daemons export comes from them: none is stood in for.
        for name in REAL_SERIES:
            expr = f'count({{__name__="{name}", job=~"tessera-coordinator|tessera-worker"}})'
            deadline = time.time() + 30
            while True:
                real = query(prometheus, expr).get("data", {}).get("result")
                if real or time.time() > deadline:
                    break
                time.sleep(1)
            (passed if real else failed).append(
                f"{name} comes from a real coordinator or worker" if real
                else f"{name}: no real coordinator or worker exports it")
        # Stand-ins only for what needs a GPU (none here), under their own scrape jobs.
        synthetic.series = {"tessera": gpu_series(training), "dcgm": dcgm_series()}
        print("stand-in series (need a GPU): "
              f"{sorted(gpu_series(training))} (job tessera-synthetic), "
              f"{sorted(dcgm_series())} (job dcgm-exporter)")

        # Every panel's query returns data (give rates and fresh series up to 30 s). A subquery
        # ([1h:1m]) evaluates at whole minutes of the clock, so it has data only once a minute
        # boundary has passed since the series' first sample: give it up to 70 s.
        for board, title, expr in panel_queries():
            resolved = substitute(expr, training)
            name = f"{board} / {title}: {resolved}"
            subquery = re.search(r":\d+m\]", resolved) is not None
            deadline = time.time() + (70 if subquery else 30)
            while True:
                answer = query(prometheus, resolved)
                ok = answer.get("status") == "success"
                result = answer.get("data", {}).get("result", []) if ok else []
                # NaN is no data to Grafana (a quantile of a histogram with no observations).
                result = [r for r in result if r["value"][1] not in ("NaN", "+Inf", "-Inf")]
                if not ok or result or time.time() > deadline:
                    break
                time.sleep(1)
            if not ok:
                failed.append(f"{name}: {answer.get('error')}")
            elif result:
                passed.append(name)
            else:
                failed.append(f"{name}: no data (or only NaN)")

        # Every annotation's query is valid (restarts, checkpoints and preemptions are events:
        # their queries have data only around one).
        for path in sorted(DASHBOARDS.glob("*.json")):
            for note in json.loads(path.read_text())["annotations"]["list"]:
                resolved = substitute(note["expr"], training)
                answer = query(prometheus, resolved)
                (passed if answer.get("status") == "success" else failed).append(
                    f"{path.stem} / annotation {note['name']}: {resolved} "
                    f"{answer.get('error', '')}".rstrip())

        # The NaN-loss and failed-job alerts fire for the diverged job.
        for alert, label, value in (("TesseraTrainingLossNaN", "job_id", diverging),
                                    ("TesseraJobFailed", "kind", "nan_loss")):
            deadline = time.time() + 60
            firing = False
            while not firing and time.time() < deadline:
                alerts = http_json(f"http://{prometheus}/api/v1/alerts")["data"]["alerts"]
                firing = any(a["labels"].get("alertname") == alert and a["state"] == "firing"
                             and a["labels"].get(label) == value for a in alerts)
                if not firing:
                    time.sleep(1)
            (passed if firing else failed).append(f"alert {alert} fires for {label}={value}")
        # And nothing fires for the healthy job. Pending alerts do not count: a rule's `for`
        # exists to ride out what a loaded 2-core machine shows now and then (rank skew
        # passing 1.3 for a few seconds), and the rules without one (NaN loss, stalled, no
        # checkpoint, GPU errors) fire at once, so they are checked all the same.
        alerts = http_json(f"http://{prometheus}/api/v1/alerts")["data"]["alerts"]
        healthy = [a["labels"]["alertname"] for a in alerts
                   if a["labels"].get("job_id") == training and a["state"] == "firing"]
        pending = [a["labels"]["alertname"] for a in alerts
                   if a["labels"].get("job_id") == training and a["state"] != "firing"]
        if pending:
            print(f"pending (not firing) for the healthy job: {pending}")
        (failed if healthy else passed).append(f"no alert fires for the healthy job {training}: "
                                               f"{healthy}")
        cli(["cancel", training], args.bin_dir, coordinator)
    except Exception as error:  # the cluster's logs say why
        failed.append(f"setup: {error}")
        for log in sorted(work.glob("*.log")):
            print(f"--- {log.name} (last 20 lines)")
            print("\n".join(log.read_text().splitlines()[-20:]))
    finally:
        cluster.stop()
        synthetic.stop()

    for name in passed:
        print(f"PASS {name}")
    for name in skipped:
        print(f"SKIP {name}")
    for name in failed:
        print(f"FAIL {name}")
    print(f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
    if not failed:
        subprocess.run(["rm", "-rf", str(work)])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
