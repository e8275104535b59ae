#!/usr/bin/env python3
"""Tests of the Helm chart (deploy/helm/tessera) with real tools, offline.

- Renders the chart with Helm itself (helm-python-sdk, Helm v4 as a library) for several values
  sets, and validates every object against Kubernetes' OpenAPI schemas in strict mode
  (kubernetes-validate) for Kubernetes 1.30 and the newest version it ships.
- Validates the Prometheus Operator objects against deploy/tests/prometheus_operator_schemas.json
  and runs the PrometheusRule's groups through `promtool check rules`.
- Checks that values.schema.json refuses a typo and a wrong type, the properties a deployment
  relies on (gRPC probes, GPUs requested, non-root, no service account token, dashboards
  labelled for Grafana's sidecar), and that deploy/manifests/tessera.yaml is a fresh render.

`--write` regenerates deploy/manifests/tessera.yaml instead (deploy/render.sh). Prints
"N passed, N failed"; exits 77 (skipped) when the tools are not installed.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

try:
    import jsonschema
    import kubernetes_validate.utils as kv
    import yaml
    from helm_python.chart import Chart
    from helm_python.errors import HelmError
except ImportError as error:
    print(f"skipped: deploy tools missing ({error}); scripts/bootstrap.sh --print-tools-python "
          "installs them")
    sys.exit(77)

DEPLOY = pathlib.Path(__file__).resolve().parent.parent
CHART = DEPLOY / "helm" / "tessera"
MANIFESTS = DEPLOY / "manifests" / "tessera.yaml"
OPERATOR_SCHEMAS = json.loads((DEPLOY / "tests" / "prometheus_operator_schemas.json").read_text())
KUBERNETES_VERSIONS = ["1.30.0", kv.latest_version()]

VALUES_SETS = {
    "defaults": {},
    "monitoring and network policy": {
        "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                    "prometheusRule": {"enabled": True, "labels": {"release": "prom"}}},
        "networkPolicy": {"enabled": True, "clientPodSelector": {"matchLabels": {"app": "ci"}},
                          "metricsNamespaceSelector": {"matchLabels": {"name": "monitoring"}}},
    },
    "existing claim, CPU-only nodes": {
        "sharedStorage": {"existingClaim": "team-nfs"},
        "worker": {"gpusPerNode": 0, "cpuSlots": 4, "nodeSelector": {}, "tolerations": [],
                   "hostIPC": False, "labels": {"pool": "cpu", "zone": "a"}},
        "grafana": {"dashboards": {"enabled": False}},
        "logFormat": "text",
    },
}

DEFAULT_RELEASE = {"name": "tessera", "namespace": "tessera"}


def render(values, release=DEFAULT_RELEASE):
    with Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values=values, **release)
    return {path: text for path, text in sorted(rendered.items()) if path.endswith(".yaml")}


def objects(rendered):
    for text in rendered.values():
        for obj in yaml.safe_load_all(text):
            if obj:
                yield obj


def manifest_text(rendered):
    parts = []
    for path, text in rendered.items():
        body = text.strip()
        if body:
            parts.append(f"# Source: {path}\n{body}\n")
    header = ("# Tessera, rendered from deploy/helm/tessera with its default values (release "
              "\"tessera\", namespace \"tessera\")\n# by deploy/render.sh. For `kubectl create "
              "namespace tessera && kubectl apply -f` users; edit\n# the chart, not this file.\n")
    return header + "---\n".join(parts)


class Results:
    def __init__(self):
        self.passed, self.failed = [], []

    def check(self, ok, name, detail=""):
        (self.passed if ok else self.failed).append(name + (f": {detail}" if detail and not ok else ""))


def test_values_set(results, label, values, promtool):
    rendered = render(values)
    objs = list(objects(rendered))
    results.check(len(objs) >= 6, f"{label}: renders", f"{len(objs)} objects")
    for obj in objs:
        kind = obj.get("kind")
        name = f"{label}: {kind}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            try:
                jsonschema.validate(obj, {**OPERATOR_SCHEMAS[kind],
                                          "definitions": OPERATOR_SCHEMAS["definitions"]})
                results.check(True, f"{name} matches the operator schema")
            except jsonschema.ValidationError as error:
                results.check(False, f"{name} matches the operator schema", error.message)
            if kind == "PrometheusRule" and promtool:
                with tempfile.NamedTemporaryFile("w", suffix=".yaml") as rules:
                    yaml.safe_dump({"groups": obj["spec"]["groups"]}, rules)
                    rules.flush()
                    out = subprocess.run([promtool, "check", "rules", rules.name],
                                         capture_output=True, text=True)
                results.check(out.returncode == 0, f"{name} passes promtool check rules",
                              out.stdout + out.stderr)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kv.validate(obj, version, strict=True)
                results.check(True, f"{name} valid in Kubernetes {version} (strict)")
            except (kv.ValidationError, kv.SchemaNotFoundError) as error:
                results.check(False, f"{name} valid in Kubernetes {version} (strict)",
                              str(getattr(error, "message", error)))
    return objs


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--promtool", default="")
    parser.add_argument("--write", action="store_true",
                        help=f"write {MANIFESTS.relative_to(DEPLOY.parent)} and exit")
    args = parser.parse_args()
    if args.write:
        MANIFESTS.parent.mkdir(parents=True, exist_ok=True)
        MANIFESTS.write_text(manifest_text(render({})))
        print(f"wrote {MANIFESTS}")
        return 0

    results = Results()
    rendered_sets = {label: test_values_set(results, label, values, args.promtool)
                     for label, values in VALUES_SETS.items()}

    # What a deployment relies on.
    default = rendered_sets["defaults"]
    coordinator = by_kind(default, "StatefulSet")[0]["spec"]
    pod = coordinator["template"]["spec"]
    container = pod["containers"][0]
    results.check(coordinator["replicas"] == 1, "coordinator: one replica (single-writer SQLite)")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        results.check("grpc" in container.get(probe, {}), f"coordinator: {probe} is a gRPC probe")
    results.check(coordinator["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"],
                  "coordinator: state on its own PVC")
    results.check("--log-format=json" in container["args"], "coordinator: JSON logs by default")
    worker = by_kind(default, "DaemonSet")[0]["spec"]["template"]["spec"]
    worker_container = worker["containers"][0]
    results.check(worker_container["resources"]["limits"].get("nvidia.com/gpu") == 8,
                  "worker: requests the node's GPUs")
    results.check(worker.get("hostIPC") is True and any(
        v.get("emptyDir", {}).get("medium") == "Memory" for v in worker["volumes"]),
        "worker: hostIPC and a memory-backed /dev/shm for NCCL")
    for spec in (pod, worker):
        results.check(spec["securityContext"].get("runAsNonRoot") is True
                      and spec.get("automountServiceAccountToken") is False,
                      "pods run as non-root without a service account token")
    claims = by_kind(default, "PersistentVolumeClaim")
    results.check(any(c["spec"]["accessModes"] == ["ReadWriteMany"] for c in claims),
                  "a ReadWriteMany claim for data and checkpoints")
    dashboards = [o for o in by_kind(default, "ConfigMap") if "dashboard" in o["metadata"]["name"]]
    results.check(len(dashboards) == 3 and all(
        o["metadata"]["labels"].get("grafana_dashboard") == "1" and
        all(json.loads(v)["panels"] for v in o["data"].values()) for o in dashboards),
        "three dashboards as ConfigMaps labelled for Grafana's sidecar")
    every = [o for objs in rendered_sets.values() for o in objs]
    results.check(not [o for o in every if o["kind"] in ("Role", "ClusterRole", "RoleBinding",
                                                           "ClusterRoleBinding")],
                  "no RBAC granted (the daemons never call the Kubernetes API)")
    monitoring = rendered_sets["monitoring and network policy"]
    rule = by_kind(monitoring, "PrometheusRule")[0]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    results.check({"TesseraTrainingLossNaN", "TesseraNodeLost", "TesseraCoordinatorDown"} <= alerts,
                  "the PrometheusRule carries the alert rules file", str(alerts))
    cpu = rendered_sets["existing claim, CPU-only nodes"]
    cpu_worker = by_kind(cpu, "DaemonSet")[0]["spec"]["template"]["spec"]["containers"][0]
    results.check("nvidia.com/gpu" not in cpu_worker["resources"]["limits"]
                  and "--cpu-slots=4" in cpu_worker["args"]
                  and "--labels=pool=cpu,zone=a" in cpu_worker["args"],
                  "CPU-only workers: no GPU request, CPU slots and labels passed")
    results.check(not by_kind(cpu, "PersistentVolumeClaim"), "an existing claim is not created")

    # The values schema refuses mistakes.
    for label, bad, why in (("a typo", {"coordinatr": {"grpcPort": 1}}, "'coordinatr' not allowed"),
                            ("a wrong type", {"worker": {"gpusPerNode": "eight"}}, "/worker/gpusPerNode"),
                            ("a bad duration", {"coordinator": {"heartbeatTimeout": "soon"}},
                             "/coordinator/heartbeatTimeout")):
        try:
            render(bad)
            results.check(False, f"values schema refuses {label}", "rendered")
        except HelmError as error:
            results.check(why in str(error), f"values schema refuses {label}, naming it", str(error))

    # The plain manifests are the chart's default render.
    fresh = manifest_text(render({}))
    results.check(MANIFESTS.exists() and MANIFESTS.read_text() == fresh,
                  f"{MANIFESTS.name} equals a fresh render (deploy/render.sh)")

    for name in results.passed:
        print(f"PASS {name}")
    for name in results.failed:
        print(f"FAIL {name}")
    print(f"{len(results.passed)} passed, {len(results.failed)} failed")
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
