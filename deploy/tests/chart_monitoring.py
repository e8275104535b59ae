"""Chart tests of the monitoring values: alert routing labels, runbook links,
thresholds and disabled alerts rendered into the PrometheusRule, their schema refusals, and
metrics.gpuSource (the worker's DCGM series dropped and the dashboards' scrape job variable
pointed at dcgm-exporter). Called by chart_test.py.
"""
import json
import re

from helm_python.errors import HelmError

from chart_common import DEPLOY, by_kind, render, render_objects

# Rendered and validated strictly by chart_test.py with its other values sets.
VALUES_SETS = {
    "GPUs from dcgm-exporter, alerts routed": {
        "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                    "prometheusRule": {"enabled": True}, "gpuSource": "dcgm"},
        "alerts": {"owner": "gpu-infra", "labels": {"queue": "research"},
                   "disabled": ["TesseraLossSpike"], "thresholds": {"gpuTempCelsius": 80}},
    },
}
RUNBOOKS = DEPLOY.parent / "docs" / "runbooks.md"
MONITORING = {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
              "prometheusRule": {"enabled": True}}


def rules_of(values):
    objs = render_objects({**values, "metrics": {**MONITORING, **values.get("metrics", {})}})
    return {r["alert"]: r for g in by_kind(objs, "PrometheusRule")[0]["spec"]["groups"]
            for r in g["rules"]}


def runbook_anchors():
    """GitHub's anchors of docs/runbooks.md's headings."""
    anchors = set()
    for line in RUNBOOKS.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def test_alert_values(results):
    rules = rules_of({})
    anchors = runbook_anchors()
    for name, rule in sorted(rules.items()):
        labels, annotations = rule.get("labels", {}), rule.get("annotations", {})
        results.check(labels.get("severity") in ("critical", "warning")
                      and labels.get("team") == "ml-platform",
                      f"alert {name}: severity and team labels", str(labels))
        results.check({"summary", "description", "runbook_url"} <= set(annotations),
                      f"alert {name}: summary, description and runbook_url", str(annotations))
        url = annotations.get("runbook_url", "")
        results.check(url.startswith("https://github.com/example/tessera/blob/main/docs/runbooks.md#")
                      and url.split("#", 1)[1] in anchors,
                      f"alert {name}: runbook_url names a section of docs/runbooks.md", url)
    for new in ("TesseraWorkerDown", "TesseraGpuEccErrors", "TesseraGpuXid", "TesseraGpuHot",
                "TesseraGpuThrottled", "TesseraVolumeNearlyFull", "TesseraJobStalled",
                "TesseraNoCheckpoint"):
        results.check(new in rules, f"alert {new} is in the rules")

    custom = rules_of({"alerts": {
        "owner": "training-infra", "labels": {"queue": "research", "severity": "info"},
        "runbookBaseUrl": "https://wiki.example.com/tessera/runbooks",
        "disabled": ["TesseraGpuHot", "TesseraLossSpike"],
        "thresholds": {"gpuTempCelsius": 79, "gpuHotFor": "3m", "jobStalledMinutes": 7,
                       "noCheckpointHours": 2, "volumeAvailableRatio": 0.25,
                       "mfuDropRatio": 0.55}}})
    results.check("TesseraGpuHot" not in custom and "TesseraLossSpike" not in custom
                  and "TesseraGpuThrottled" in custom,
                  "alerts.disabled leaves out exactly the named alerts", str(sorted(custom)))
    stalled = custom["TesseraJobStalled"]
    results.check(stalled["labels"] == {"severity": "critical", "team": "training-infra",
                                        "queue": "research"},
                  "alerts.owner and alerts.labels label every alert; a rule's severity wins",
                  str(stalled["labels"]))
    results.check(stalled["annotations"]["runbook_url"]
                  == "https://wiki.example.com/tessera/runbooks#tesserajobstalled",
                  "alerts.runbookBaseUrl prefixes runbook_url",
                  stalled["annotations"]["runbook_url"])
    results.check("> 7 * 60" in stalled["expr"] and "[7m:1m]) >= 7" in stalled["expr"]
                  and "7 minutes" in stalled["annotations"]["description"],
                  "jobStalledMinutes reaches the stalled rule and its description", stalled["expr"])
    checkpoint = custom["TesseraNoCheckpoint"]["expr"]
    results.check("> 2 * 3600" in checkpoint and "[2h:10m]" in checkpoint and ">= 12" in checkpoint,
                  "noCheckpointHours reaches both halves of the no-checkpoint rule", checkpoint)
    results.check(custom["TesseraMfuDrop"]["expr"].startswith("tessera_train_mfu_ratio < 0.55 *")
                  and "below 55% of" in custom["TesseraMfuDrop"]["annotations"]["description"],
                  "mfuDropRatio reaches the MFU rule", custom["TesseraMfuDrop"]["expr"])
    volume = custom["TesseraVolumeNearlyFull"]["expr"]
    results.check("< 0.25" in volume and 'namespace="tessera"' in volume
                  and "state-tessera-coordinator-[0-9]+|tessera-shared" in volume,
                  "the volume rule selects the release's claims in its namespace", volume)
    claim = rules_of({"sharedStorage": {"existingClaim": "team-nfs"}})["TesseraVolumeNearlyFull"]
    results.check("|team-nfs\"" in claim["expr"], "the volume rule follows an existing claim",
                  claim["expr"])

    try:
        rules_of({"alerts": {"disabled": ["TesseraGpuHott"]}})
        results.check(False, "alerts.disabled naming no alert is refused", "rendered")
    except HelmError as error:
        results.check('alerts.disabled: no alert is named "TesseraGpuHott"' in str(error),
                      "alerts.disabled naming no alert is refused, naming it", str(error))
    stalled_default = rules["TesseraJobStalled"]["expr"]
    results.check("[15m:1m]) >= 15" in stalled_default and "> 15 * 60" in stalled_default,
                  "the stalled rule covers jobs with and without a first step", stalled_default)

    for label, bad, why in (
            ("a typo in alerts.thresholds", {"alerts": {"thresholds": {"gpuTemp": 80}}},
             "'gpuTemp' not allowed"),
            ("a threshold of the wrong type", {"alerts": {"thresholds": {"jobStalledMinutes": "15m"}}},
             "/alerts/thresholds/jobStalledMinutes"),
            ("a duration Prometheus refuses", {"alerts": {"thresholds": {"gpuHotFor": "1.5m"}}},
             "/alerts/thresholds/gpuHotFor"),
            ("a runbook URL without a scheme", {"alerts": {"runbookBaseUrl": "wiki/runbooks"}},
             "/alerts/runbookBaseUrl"),
            ("a ratio above 1", {"alerts": {"thresholds": {"volumeAvailableRatio": 10}}},
             "/alerts/thresholds/volumeAvailableRatio")):
        try:
            render(bad)
            results.check(False, f"values schema refuses {label}", "rendered")
        except HelmError as error:
            results.check(why in str(error), f"values schema refuses {label}, naming it", str(error))


def scrape_job_defaults(objs):
    """{dashboard file: the `job` variable's default} of the rendered dashboards that have one."""
    defaults = {}
    for configmap in by_kind(objs, "ConfigMap"):
        for key, text in configmap.get("data", {}).items():
            if key.endswith(".json"):
                for variable in json.loads(text)["templating"]["list"]:
                    if variable["name"] == "job":
                        defaults[key] = variable["current"]["value"]
    return defaults


def test_gpu_source(results):
    for source, job in (("worker", "tessera-worker"), ("dcgm", "dcgm-exporter")):
        objs = render_objects({"metrics": {**MONITORING, "gpuSource": source,
                                           "dcgmJob": "dcgm-exporter"}})
        endpoint = by_kind(objs, "PodMonitor")[0]["spec"]["podMetricsEndpoints"][0]
        drops = [r for r in endpoint.get("metricRelabelings", [])
                 if r.get("action") == "drop" and r.get("sourceLabels") == ["__name__"]]
        dropped = [n for n in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                               "tessera_task_gpu_info", "tessera_gpu_xid_errors_total",
                               "tessera_train_loss")
                   if any(re.fullmatch(r["regex"], n) for r in drops)]
        want = ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] if source == "dcgm" else []
        results.check(dropped == want,
                      f"gpuSource={source}: the worker PodMonitor drops {want or 'nothing'}",
                      str(dropped))
        defaults = scrape_job_defaults(objs)
        results.check(defaults == {"tessera-training.json": job, "tessera-gpus.json": job},
                      f"gpuSource={source}: the training and GPU dashboards' job variable "
                      f"defaults to {job}", str(defaults))
        boards = {k: json.loads(v) for c in by_kind(objs, "ConfigMap")
                  for k, v in c.get("data", {}).items() if k.endswith(".json")}
        results.check(len(boards) == 3 and all(b["panels"] for b in boards.values()),
                      f"gpuSource={source}: three dashboards, each with panels")
    try:
        render({"metrics": {"gpuSource": "nvml"}})
        results.check(False, "values schema refuses gpuSource=nvml", "rendered")
    except HelmError as error:
        results.check("/metrics/gpuSource" in str(error),
                      "values schema refuses gpuSource=nvml, naming it", str(error))


def test_monitoring(results):
    test_alert_values(results)
    test_gpu_source(results)
