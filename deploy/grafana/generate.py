#!/usr/bin/env python3
"""Generates Tessera's Grafana dashboards (deploy/helm/tessera/files/dashboards/*.json).

The dashboards are code so that every panel has the same datasource, units and variables, and so
that a reviewer reads a short list of queries rather than Grafana's JSON. Run it after a change:

    python3 deploy/grafana/generate.py            # writes the JSON files
    python3 deploy/grafana/generate.py --check    # lints them and fails if they are stale

deploy/tests/prometheus_test.py runs every query below against a real Prometheus server.
"""
import argparse
import json
import pathlib
import re
import sys

OUT = pathlib.Path(__file__).resolve().parent.parent / "helm" / "tessera" / "files" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
JOB = 'job_id=~"$job_id"'
# The scrape job whose DCGM_* series the GPU panels read: the workers' (tessera-worker) or
# dcgm-exporter's. The chart's metrics.gpuSource=dcgm sets its default to metrics.dcgmJob.
SCRAPE = 'job=~"$job"'
GPU = f'{SCRAPE}, Hostname=~"$Hostname", gpu=~"$gpu"'
RATE = "$__rate_interval"
# Joins any per-GPU series to the job and rank holding that GPU (the worker's
# tessera_task_gpu_info{job_id,rank,node,gpu,UUID} 1 of every running task).
TO_JOB = f"* on (UUID) group_left (job_id, rank) tessera_task_gpu_info{{{JOB}}}"
PHASES = "tessera_train_phase_seconds_total"
COLLECTIVES = "tessera_train_collective_seconds_total"
RANK_STEPS = "tessera_train_rank_steps_total"


def datasource_variable():
    return {"name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0}


def query_variable(name, label, query, multi=True):
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "definition": query, "query": {"query": query, "refId": name},
            "refresh": 2, "includeAll": multi, "multi": multi, "allValue": ".*",
            "current": {}, "sort": 1, "hide": 0}


def scrape_job_variable():
    """`job`: which scrape job's GPU series to draw, so that a cluster running dcgm-exporter beside
    the workers draws each GPU once."""
    return {"name": "job", "label": "GPU metrics from", "type": "query", "datasource": DATASOURCE,
            "definition": "label_values(DCGM_FI_DEV_GPU_TEMP, job)",
            "query": {"query": "label_values(DCGM_FI_DEV_GPU_TEMP, job)", "refId": "job"},
            "refresh": 2, "includeAll": False, "multi": False,
            "current": {"text": "tessera-worker", "value": "tessera-worker"}, "sort": 1, "hide": 0}


def target(expr, legend, ref):
    return {"refId": ref, "expr": expr, "legendFormat": legend, "datasource": DATASOURCE}


def panel(title, targets, unit="short", kind="timeseries", description="", width=12,
          overrides=None, stacked=False):
    """A panel; `targets` is a list of (expr, legend)."""
    defaults = {"unit": unit}
    if stacked:
        defaults["custom"] = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60}
    return {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "targets": [target(e, l, chr(ord("A") + i)) for i, (e, l) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "_width": width,
    }


def row(title):
    """A full-width row header; the panels after it, up to the next row, belong to it."""
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_width": 24,
            "_height": 1}


def annotation(name, expr, text, color):
    """Events drawn across every panel: a point wherever `expr` has a value."""
    return {"name": name, "datasource": DATASOURCE, "enable": True, "iconColor": color,
            "expr": expr, "step": "1m", "titleFormat": name, "textFormat": text,
            "useValueForTime": False}


# On every dashboard: a dropdown of the other Tessera dashboards, keeping the time range.
LINKS = [{"type": "dashboards", "tags": ["tessera"], "asDropdown": True, "keepTime": True,
          "includeVars": False, "title": "Tessera dashboards"}]


def dashboard(uid, title, description, variables, panels, annotations=()):
    x = y = 0
    line_height = 0
    laid = []
    for i, p in enumerate(panels, start=1):
        width = p.pop("_width")
        height = p.pop("_height", 8)
        if x + width > 24 or (p["type"] == "row" and x > 0):
            x, y, line_height = 0, y + line_height, 0
        laid.append({"id": i, "gridPos": {"x": x, "y": y, "w": width, "h": height}, **p})
        x += width
        line_height = max(line_height, height)
    return {
        "uid": uid, "title": title, "description": description, "tags": ["tessera"],
        "editable": True, "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "timezone": "browser",
        "templating": {"list": variables}, "annotations": {"list": list(annotations)},
        "links": LINKS, "panels": laid,
    }


def training():
    eval_points = [{"matcher": {"id": "byRegexp", "options": ".* eval"},
                    "properties": [{"id": "custom.drawStyle", "value": "points"},
                                   {"id": "custom.pointSize", "value": 8}]}]
    return dashboard(
        "tessera-training", "Tessera / Training",
        "Per job: loss with evaluations, throughput, MFU, step time, gradient norm, learning "
        "rate, peak memory, checkpoint stalls, per-rank step time and skew, restarts and "
        "failures.",
        [datasource_variable(),
         query_variable("job_id", "Job", "label_values(tessera_train_step, job_id)"),
         scrape_job_variable()],
        [
            panel("Loss (train, eval as points)",
                  [(f"tessera_train_loss{{{JOB}}}", "{{job_id}} train"),
                   (f"tessera_eval_loss{{{JOB}}}", "{{job_id}} eval")],
                  overrides=eval_points,
                  description="Newest step's training loss; evaluations drawn as points."),
            panel("Tokens per second", [(f"sum by (job_id) (tessera_train_tokens_per_second{{{JOB}}})",
                                         "{{job_id}}")], unit="short"),
            panel("MFU", [(f"tessera_train_mfu_ratio{{{JOB}}}", "{{job_id}}")],
                  unit="percentunit",
                  description="6 x parameters x tokens/s over the GPUs' dense bf16 peak; 0 on CPU."),
            panel("Step time per rank",
                  [(f"tessera_train_step_time_seconds{{{JOB}}}", "{{job_id}} rank {{rank}}")],
                  unit="s", description="Each rank's newest step, wall time."),
            panel("Gradient norm", [(f"tessera_train_grad_norm{{{JOB}}}", "{{job_id}}")]),
            panel("Learning rate", [(f"tessera_train_learning_rate{{{JOB}}}", "{{job_id}}")],
                  unit="sci"),
            panel("Peak memory per rank",
                  [(f"tessera_train_peak_memory_bytes{{{JOB}}}", "{{job_id}} rank {{rank}}")],
                  unit="bytes",
                  description="GPU memory allocated at the newest step's peak (process RSS on "
                              "CPU); compare with the plan's estimate in `tessera get`."),
            panel("Step time held by checkpoints",
                  [(f"max by (job_id) (tessera_train_checkpoint_blocked_seconds{{{JOB}}})",
                    "{{job_id}}")],
                  unit="s",
                  description="How long the newest step waited for a checkpoint save: the "
                              "snapshot to host memory, or a previous save still writing."),
            panel("Busy seconds per step, by rank",
                  [(f"tessera_rank_step_seconds{{{JOB}}}", "{{job_id}} rank {{rank}}")],
                  unit="s",
                  description="Time each rank computes per step, excluding waits for its peers: "
                              "the straggler is the highest line."),
            panel("Rank skew (slowest / median)",
                  [(f"tessera_job_straggler_skew{{{JOB}}}", "{{job_id}}")],
                  description="1 is even; the TesseraStragglerRank alert fires above 1.3."),
            panel("Step", [(f"max by (job_id) (tessera_train_step{{{JOB}}})", "{{job_id}}")],
                  kind="stat", width=8),
            panel("Restarts by cause (range)",
                  [(f"sum by (kind) (increase(tessera_job_restarts_total[$__range]))", "{{kind}}")],
                  kind="stat", width=8),
            panel("Failed jobs by cause (range)",
                  [(f"sum by (kind) (increase(tessera_job_failures_total[$__range]))", "{{kind}}")],
                  kind="stat", width=8),
        ] + where_the_time_goes() + job_gpus(),
        annotations=[
            annotation("Restarts", "sum by (kind) (increase(tessera_job_restarts_total[1m])) > 0",
                       "{{kind}}", "orange"),
            annotation("Checkpoints",
                       f"changes(tessera_job_last_checkpoint_timestamp_seconds{{{JOB}}}[1m]) > 0",
                       "{{job_id}}", "green"),
            annotation("Preemptions",
                       "sum by (queue, reason) (increase(tessera_queue_preemptions_total[1m])) > 0",
                       "{{queue}} {{reason}}", "red"),
        ])


def where_the_time_goes():
    """The training dashboard's breakdown of step time: the trainers' per-phase and
    per-collective counters, summed over ranks, per step or as shares of wall time."""
    per_step = f"sum by (job_id) (rate({RANK_STEPS}{{{JOB}}}[{RATE}]))"
    return [
        row("Where the time goes"),
        panel("Share of step time by phase",
              [(f"sum by (job_id, phase) (rate({PHASES}{{{JOB}}}[{RATE}])) / ignoring (phase) "
                f"group_left sum by (job_id) (rate({PHASES}{{{JOB}}}[{RATE}]))",
                "{{job_id}} {{phase}}")],
              unit="percentunit", stacked=True,
              description="Forward, backward, optimizer, data wait, checkpoint blocked and the "
                          "rest, as shares of all ranks' step time: a growing data_wait is a slow "
                          "loader or storage, checkpoint_blocked a save holding the step."),
        panel("Seconds per step by phase",
              [(f"sum by (job_id, phase) (rate({PHASES}{{{JOB}}}[{RATE}])) / ignoring (phase) "
                f"group_left {per_step}", "{{job_id}} {{phase}}")],
              unit="s", stacked=True,
              description="Each phase's time per step, averaged over ranks; the stack is the "
                          "step time."),
        panel("Collective time per step by kind and dimension",
              [(f"sum by (job_id, kind, dim) (rate({COLLECTIVES}{{{JOB}}}[{RATE}])) / "
                f"ignoring (kind, dim) group_left {per_step}", "{{job_id}} {{kind}} {{dim}}")],
              unit="s",
              description="Seconds per step, averaged over ranks, in each collective (all_reduce, "
                          "reduce_scatter, all_gather, all_to_all, broadcast, send_recv) of each "
                          "process-group dimension (dp, tp, pp, cp, ep, edp, dcp)."),
        panel("Collective bandwidth by kind and dimension",
              [(f"sum by (job_id, kind, dim) (rate(tessera_train_collective_bytes_total{{{JOB}}}"
                f"[{RATE}])) / sum by (job_id, kind, dim) (rate({COLLECTIVES}{{{JOB}}}[{RATE}]))",
                "{{job_id}} {{kind}} {{dim}}")],
              unit="Bps",
              description="Bytes moved per second spent in the collective (algorithm "
                          "bandwidth): far under the link's speed means latency-bound messages or "
                          "a slow peer."),
        panel("Data wait per rank (seconds per step)",
              [(f'sum by (job_id, rank) (rate({PHASES}{{{JOB}, phase="data_wait"}}[{RATE}])) / '
                f"sum by (job_id, rank) (rate({RANK_STEPS}{{{JOB}}}[{RATE}]))",
                "{{job_id}} rank {{rank}}")],
              unit="s", description="A rank waiting on its loader longer than the others slows "
                                    "every rank at the next collective."),
        panel("Seconds since the newest step (stalled)",
              [(f"time() - max by (job_id) (tessera_job_last_step_timestamp_seconds{{{JOB}}})",
                "{{job_id}}")],
              unit="s", kind="stat", width=8,
              description="Kept by the coordinator for every RUNNING job while its ranks are "
                          "silent; TesseraJobStalled fires past alerts.thresholds.jobStalledMinutes."),
        panel("Since the newest checkpoint",
              [(f"time() - max by (job_id) (tessera_job_last_checkpoint_timestamp_seconds{{{JOB}}})",
                "{{job_id}}")],
              unit="s", kind="stat", width=8,
              description="Work a restart would lose; TesseraNoCheckpoint fires past "
                          "alerts.thresholds.noCheckpointHours."),
        panel("ETA",
              [(f"(max by (job_id) (tessera_train_max_steps{{{JOB}}}) - max by (job_id) "
                f"(tessera_train_steps_total{{{JOB}}})) / max by (job_id) "
                f"(rate(tessera_train_steps_total{{{JOB}}}[{RATE}]))", "{{job_id}}")],
              unit="s", kind="stat", width=8,
              description="Steps left over the recent step rate."),
    ]


def job_gpus():
    """The job's GPUs: any DCGM-named series of the `job` scrape job joined to the job and rank
    through tessera_task_gpu_info."""
    legend = "{{job_id}} rank {{rank}} ({{Hostname}} GPU {{gpu}})"

    def joined(title, metric, unit, description=""):
        return panel(title, [(f"{metric}{{{SCRAPE}}} {TO_JOB}", legend)], unit=unit,
                     description=description)
    return [
        row("GPUs of the job"),
        joined("GPU utilization by rank", "DCGM_FI_DEV_GPU_UTIL", "percent"),
        joined("GPU temperature by rank", "DCGM_FI_DEV_GPU_TEMP", "celsius",
               "TesseraGpuHot fires above alerts.thresholds.gpuTempCelsius."),
        joined("Clock throttle reasons by rank", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "short",
               "NVML's bitmask: 1 idle, 2 application clocks, 4 power cap, 8 hardware slowdown, "
               "16 sync boost, 32 software thermal, 64 hardware thermal, 128 power brake."),
        panel("ECC and Xid errors of the job's GPUs (range)",
              [(f"increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{SCRAPE}}}[$__range]) {TO_JOB}",
                f"{legend} uncorrectable ECC"),
               (f"increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{SCRAPE}}}[$__range]) {TO_JOB}",
                f"{legend} corrected ECC"),
               (f"increase(tessera_gpu_xid_errors_total[$__range]) {TO_JOB}", f"{legend} Xid")],
              kind="stat",
              description="Any uncorrectable ECC error or Xid on a job's GPU is worth a look: "
                          "docs/runbooks.md, TesseraGpuEccErrors and TesseraGpuXid."),
    ]


def gpus():
    def gpu_panel(title, metric, unit, description=""):
        return panel(title, [(f"{metric}{{{GPU}}}", "{{Hostname}} GPU {{gpu}}")], unit=unit,
                     description=description)
    return dashboard(
        "tessera-gpus", "Tessera / GPUs",
        "Every GPU the workers export, under dcgm-exporter's metric names.",
        [datasource_variable(), scrape_job_variable(),
         query_variable("Hostname", "Node", f"label_values(DCGM_FI_DEV_GPU_UTIL{{{SCRAPE}}}, Hostname)"),
         query_variable("gpu", "GPU",
                        f'label_values(DCGM_FI_DEV_GPU_UTIL{{{SCRAPE}, Hostname=~"$Hostname"}}, gpu)')],
        [
            gpu_panel("Utilization", "DCGM_FI_DEV_GPU_UTIL", "percent"),
            gpu_panel("Memory copy utilization", "DCGM_FI_DEV_MEM_COPY_UTIL", "percent"),
            gpu_panel("Framebuffer used", "DCGM_FI_DEV_FB_USED", "mbytes"),
            gpu_panel("Framebuffer free", "DCGM_FI_DEV_FB_FREE", "mbytes"),
            gpu_panel("Power", "DCGM_FI_DEV_POWER_USAGE", "watt"),
            gpu_panel("Temperature", "DCGM_FI_DEV_GPU_TEMP", "celsius"),
            gpu_panel("SM clock", "DCGM_FI_DEV_SM_CLOCK", "rotmhz",
                      "MHz as NVML reports it; a drop under load means throttling."),
            gpu_panel("XID errors", "DCGM_FI_DEV_XID_ERRORS", "short",
                      "The last XID error code (0: none)."),
            panel("ECC errors (range)",
                  [(f"increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{GPU}}}[$__range])",
                    "{{Hostname}} GPU {{gpu}} uncorrectable"),
                   (f"increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{GPU}}}[$__range])",
                    "{{Hostname}} GPU {{gpu}} corrected")],
                  kind="stat", description="Volatile ECC error counts over the dashboard's range."),
            panel("Xid errors (range)",
                  [('increase(tessera_gpu_xid_errors_total{Hostname=~"$Hostname", gpu=~"$gpu"}'
                    "[$__range])", "{{Hostname}} GPU {{gpu}}")],
                  kind="stat",
                  description="Xid critical errors the worker counted from NVML events (the "
                              "code of the newest is in XID errors above)."),
            gpu_panel("Clock throttle reasons", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "short",
                      "NVML's bitmask: 1 idle, 2 application clocks, 4 power cap, 8 hardware "
                      "slowdown, 16 sync boost, 32 software thermal, 64 hardware thermal, "
                      "128 power brake."),
            panel("Which job holds each GPU",
                  [('tessera_task_gpu_info{gpu=~"$gpu"}', "{{node}} GPU {{gpu}}: {{job_id}} rank {{rank}}")],
                  kind="table",
                  description="From the workers: one series per GPU a running task holds."),
        ])


def control_plane():
    requests = "tessera_grpc_server_requests_total"
    return dashboard(
        "tessera-control-plane", "Tessera / Control plane",
        "The coordinator: jobs and nodes by state, capacity, scheduling latency, heartbeats, "
        "RPC rates and errors, scheduler and store timings; leadership (leader, epoch, "
        "takeovers); queues (quota, use, borrowing, "
        "waiting jobs, fair share, preemptions, wait times); topology (fragmentation, the "
        "largest free domain and wholly free domains per level).",
        [datasource_variable()],
        overview() + [
            row("Scheduling and RPCs"),
            panel("Jobs by state", [("sum by (state) (tessera_jobs)", "{{state}}")]),
            panel("Nodes by state", [("sum by (state) (tessera_nodes)", "{{state}}")]),
            panel("GPUs and CPU slots: capacity vs allocated",
                  [("sum(tessera_gpus_capacity)", "GPUs"),
                   ("sum(tessera_gpus_allocated)", "GPUs allocated"),
                   ("sum(tessera_cpu_slots_capacity)", "CPU slots"),
                   ("sum(tessera_cpu_slots_allocated)", "CPU slots allocated")]),
            panel("Scheduling latency (submission to SCHEDULED)",
                  [(f"histogram_quantile({q}, sum by (le) (rate(tessera_scheduling_latency_seconds_bucket[{RATE}])))",
                    f"p{int(q * 100)}") for q in (0.5, 0.99)], unit="s"),
            panel("Oldest pending job", [("max(tessera_job_oldest_pending_seconds)", "age")],
                  unit="s"),
            panel("Heartbeats per second",
                  [(f'sum(rate({requests}{{method="/tessera.v1.NodeService/Heartbeat"}}[{RATE}]))',
                    "heartbeats")], unit="reqps"),
            panel("RPCs per second by method and code",
                  [(f"sum by (method, code) (rate({requests}[{RATE}]))", "{{method}} {{code}}")],
                  unit="reqps"),
            panel("RPC error ratio by method",
                  [(f'(sum by (method) (rate({requests}{{code!="OK"}}[{RATE}])) '
                    f"or sum by (method) (rate({requests}[{RATE}])) * 0) "
                    f"/ sum by (method) (rate({requests}[{RATE}]))", "{{method}}")],
                  unit="percentunit",
                  description="Calls that did not end OK (0 when none failed)."),
            panel("RPC latency p99 by method",
                  [(f'histogram_quantile(0.99, sum by (method, le) (rate(tessera_grpc_server_request_duration_seconds_bucket{{method!~".*/(WatchJob|GetLogs)"}}[{RATE}])))',
                    "{{method}}")], unit="s",
                  description="Unary calls only: a stream (WatchJob, GetLogs) lasts as long as its "
                              "client follows it."),
            panel("Call executors: busy threads and queued calls",
                  [("sum by (executor) (tessera_call_executor_busy_threads)", "{{executor}} busy"),
                   ("sum by (executor) (tessera_call_executor_threads)", "{{executor}} threads"),
                   ("sum by (executor) (tessera_call_executor_queued_calls)",
                    "{{executor}} queued"),
                   (f"sum by (executor) (rate(tessera_call_executor_refused_total[{RATE}]))",
                    "{{executor}} refused/s")],
                  description="Where the coordinator's calls wait: busy threads at the thread "
                              "count with calls queued is saturation (client calls beyond the "
                              "queue are refused, told to retry). Calls in flight: "
                              "tessera_grpc_server_started_total minus "
                              "tessera_grpc_server_requests_total."),
            panel("Scheduler pass and store write p99",
                  [(f"histogram_quantile(0.99, sum by (le) (rate(tessera_scheduler_pass_duration_seconds_bucket[{RATE}])))",
                    "scheduler pass"),
                   (f"histogram_quantile(0.99, sum by (le) (rate(tessera_store_write_duration_seconds_bucket[{RATE}])))",
                    "store write")], unit="s"),
            panel("Scheduler busy by phase",
                  [(f"sum by (phase) (rate(tessera_scheduler_pass_phase_seconds_sum[{RATE}]))",
                    "{{phase}}")], unit="percentunit",
                  description="Share of wall time the scheduler thread spent in each phase of its "
                              "passes. Near 100% in all, passes run back to back and placement "
                              "waits for them. store_overlapped is the store thread's share, "
                              "storing each pass's placements beside the next pass (not part of "
                              "the scheduler thread's sum; store is its wait to hand them over)."),
            panel("Store writer busy (share of one core)",
                  [(f"sum(rate(tessera_store_write_cpu_seconds_total[{RATE}]))", "writer")],
                  unit="percentunit",
                  description="The store applies every write on one connection, one transaction "
                              "at a time, so this CPU is serial whatever the core count. Near "
                              "100%, the writer limits how fast jobs are placed and reported."),
            panel("Store writes per second",
                  [(f"sum(rate(tessera_store_writes_total[{RATE}]))", "writes"),
                   (f"sum(rate(tessera_store_write_duration_seconds_count[{RATE}]))",
                    "transactions")], unit="ops",
                  description="Writes (a job's change, a node record) and the group-commit "
                              "transactions that carry them."),
        ] + leadership() + queues() + topology())


def overview():
    """The control-plane dashboard's first row: the cluster at a glance."""
    return [
        row("Overview"),
        panel("Jobs running", [('sum(tessera_jobs{state="running"})', "running")], kind="stat",
              width=6),
        panel("Jobs pending", [('sum(tessera_jobs{state="pending"})', "pending")], kind="stat",
              width=6),
        panel("GPUs in use", [("sum(tessera_gpus_allocated) / (sum(tessera_gpus_capacity) > 0) or "
                               "sum(tessera_cpu_slots_allocated) / sum(tessera_cpu_slots_capacity)",
                               "in use")],
              unit="percentunit", kind="stat", width=6,
              description="Allocated over capacity: GPUs, or CPU slots on a cluster without "
                          "GPUs."),
        panel("Tokens per second, all jobs",
              [(f"sum(rate(tessera_train_tokens_total[{RATE}]))", "tokens/s")], kind="stat",
              width=6),
    ]


def leadership():
    """The Leadership row of the control-plane dashboard: which coordinator leads (several run on
    PostgreSQL state; one on SQLite always leads) and the epoch, one more per takeover."""
    epoch = "max(tessera_coordinator_leader_epoch)"
    return [
        row("Leadership"),
        panel("Coordinators leading", [("sum(tessera_coordinator_leader)", "leading"),
                                       ("count(tessera_coordinator_leader)", "running")],
              kind="stat", width=6,
              description="1 leading in a healthy control plane; 0 during a failover "
                          "(TesseraNoLeader after a minute). Running counts the standbys too."),
        panel("Leadership epoch", [(epoch, "epoch")], kind="stat", width=6,
              description="Grows by one per takeover; the coordinators' log lines \"lost "
                          "leadership (epoch N, now M at ADDRESS)\" name the changes."),
        panel("Takeovers in the last hour",
              [(f"max_over_time({epoch}[1h:1m]) - min_over_time({epoch}[1h:1m])", "takeovers")],
              kind="stat", width=12,
              description="TesseraLeaderFlapping fires at alerts.thresholds.leaderChangesPerHour."),
        panel("Leader by coordinator",
              [("max by (instance) (tessera_coordinator_leader)", "{{instance}}")], width=24,
              description="1 while a coordinator leads, 0 while it stands by; a pod replaced "
                          "shows as a new instance."),
    ]


def queues():
    """The Queues row of the control-plane dashboard (series only with a --queue_file)."""
    wait = "tessera_queue_wait_seconds_bucket"
    return [
        row("Queues"),
        panel("GPUs used vs nominal, by queue",
              [("sum by (queue) (tessera_queue_used_gpus)", "{{queue}} used"),
               ("sum by (queue) (tessera_queue_nominal_gpus)", "{{queue}} nominal")],
              description="Devices each queue's jobs hold against its guaranteed quota; above "
                          "it, the queue borrows its cohort's unused quota."),
        panel("CPU slots used vs nominal, by queue",
              [("sum by (queue) (tessera_queue_used_cpu_slots)", "{{queue}} used"),
               ("sum by (queue) (tessera_queue_nominal_cpu_slots)", "{{queue}} nominal")]),
        panel("Borrowed GPUs and CPU slots, by queue",
              [("sum by (queue) (tessera_queue_borrowed_gpus)", "{{queue}} GPUs"),
               ("sum by (queue) (tessera_queue_borrowed_cpu_slots)", "{{queue}} CPU slots")],
              description="Held beyond the nominal quota: what a lending queue can reclaim by "
                          "preemption."),
        panel("Jobs waiting and placed, by queue",
              [("sum by (queue) (tessera_queue_waiting_jobs)", "{{queue}} waiting"),
               ("sum by (queue) (tessera_queue_running_jobs)", "{{queue}} placed")],
              description="Waiting: PENDING or RESTARTING without devices (`tessera get` says "
                          "why). Placed: scheduled, running or being preempted."),
        panel("Fair share, by queue", [("max by (queue) (tessera_queue_fair_share)", "{{queue}}")],
              description="Decayed dominant-resource usage over weight; within a cohort the "
                          "lowest borrows first. 0 outside a cohort."),
        panel("Preemptions per second, by queue and reason",
              [(f"sum by (queue, reason) (rate(tessera_queue_preemptions_total[{RATE}]))",
                "{{queue}} {{reason}}")], unit="ops",
              description="Jobs asked to save a checkpoint and stop: reclaim (a queue took back "
                          "its lent quota) or priority (a higher priority in the same queue)."),
        panel("Queue wait p50 and p95 (entering the queue to SCHEDULED)",
              [(f"histogram_quantile({q}, sum by (queue, le) (rate({wait}[{RATE}])))",
                f"{{{{queue}}}} p{int(q * 100)}") for q in (0.5, 0.95)], unit="s", width=24,
              description="From submission, or for a restarted or preempted job from the end of "
                          "its previous attempt."),
    ]


def topology():
    """The Topology row of the control-plane dashboard (series only with --topology_levels)."""
    return [
        row("Topology"),
        panel("Fragmentation, by level",
              [("max by (level) (tessera_topology_fragmentation)", "{{level}}")],
              unit="percentunit",
              description="Share of the free devices that sit in partly used domains of the "
                          "level: 0 when every free device is in a wholly free domain. High, a "
                          "gang that needs a whole domain (placement.required) waits although "
                          "enough devices are free."),
        panel("Largest free domain and free devices, by level",
              [("max by (level) (tessera_topology_largest_free_domain_devices)",
                "{{level}} largest free domain"),
               ("max by (level) (tessera_topology_free_devices)", "{{level}} free")],
              description="The largest gang that fits inside one domain of the level, against "
                          "all free devices of the ready nodes."),
        panel("Wholly free domains, by level",
              [("max by (level) (tessera_topology_whole_free_domains)", "{{level}} wholly free"),
               ("max by (level) (tessera_topology_domains)", "{{level}} domains")], width=24,
              description="Domains with no device in use, of all the level's domains (a node "
                          "naming none at a level is a domain of its own)."),
    ]


DASHBOARDS = {"training.json": training, "gpus.json": gpus, "control-plane.json": control_plane}


def render(build):
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def lint(name, board):
    """Problems of one dashboard, as strings."""
    problems = []
    ids = [p["id"] for p in board["panels"]]
    if len(ids) != len(set(ids)):
        problems.append(f"{name}: duplicate panel ids")
    defined = {v["name"] for v in board["templating"]["list"]}
    builtin = {"__rate_interval", "__range", "__interval"}
    for a in board["annotations"]["list"]:
        for used in re.findall(r"\$\{?(\w+)", a["expr"]):
            if used not in defined and used not in builtin:
                problems.append(f"{name}: annotation '{a['name']}' uses undefined ${used}")
    for p in board["panels"]:
        if p["type"] == "row":
            continue
        if p.get("datasource") != DATASOURCE:
            problems.append(f"{name}: panel '{p['title']}' does not use ${{datasource}}")
        if not p.get("targets"):
            problems.append(f"{name}: panel '{p['title']}' has no query")
        for t in p.get("targets", []):
            for used in re.findall(r"\$\{?(\w+)", t["expr"]):
                if used not in defined and used not in builtin:
                    problems.append(f"{name}: panel '{p['title']}' uses undefined ${used}")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="lint the committed dashboards and fail if they differ from a fresh "
                             "generation")
    args = parser.parse_args()
    problems = []
    for name, build in DASHBOARDS.items():
        fresh = render(build)
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != fresh:
                problems.append(f"{path} is stale: run python3 deploy/grafana/generate.py")
                continue
            problems += lint(name, json.loads(path.read_text()))
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(fresh)
    extra = sorted(p.name for p in OUT.glob("*.json") if p.name not in DASHBOARDS)
    if args.check and extra:
        problems.append(f"dashboards not generated here: {extra}")
    for problem in problems:
        print(problem)
    if args.check:
        print(f"{len(DASHBOARDS) - len({p.split(':')[0] for p in problems})} passed, "
              f"{len(problems)} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
