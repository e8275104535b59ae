#!/usr/bin/env python3
"""Tests of the Helm chart (deploy/helm/tessera) with real tools, offline.

- Renders the chart with Helm itself (helm-python-sdk, Helm v4 as a library) for several values
  sets, and validates every object against Kubernetes' OpenAPI schemas in strict mode
  (kubernetes-validate) for Kubernetes 1.30 and the newest version it ships.
- Validates the Prometheus Operator objects against deploy/tests/prometheus_operator_schemas.json
  and runs the PrometheusRule's groups through `promtool check rules`.
- Checks that values.schema.json refuses a typo and a wrong type, the properties a deployment
  relies on (gRPC probes, GPUs requested, non-root, no service account token, dashboards
  labelled for Grafana's sidecar), the security settings (TLS, auth file and join token flags
  pointing into read-only Secret mounts, --insecure exactly when TLS is off, gRPC probes on the
  plaintext health-only port under TLS,
  trainer ports open to workers only under the NetworkPolicy; docs/security.md), and that
  deploy/manifests/tessera.yaml is a fresh render.

- chart_lifecycle.py: an upgrade to a new chart version changes no immutable field and rolls no
  pod unless the image changes; every name fits 63 characters for any release name.
- chart_ha.py: several coordinators on PostgreSQL (Deployment, password Secret, advertise
  address, anti-affinity, PodDisruptionBudget, leader-only readiness) and the refusals.
- chart_options.py: the escape hatches, worker groups, the work directory, storage and
  values-kind.yaml, and the schema's refusals of their typos and wrong types.

`--write` regenerates deploy/manifests/tessera.yaml instead (deploy/render.sh). Prints
"N passed, N failed"; exits 77 (skipped) when the tools are not installed.
"""
import argparse
import json
import subprocess
import sys
import tempfile

try:
    import jsonschema
    import kubernetes_validate.utils as kv
    import yaml
    from helm_python.chart import lint
    from helm_python.errors import HelmError

    import chart_ha
    import chart_lifecycle
    import chart_monitoring
    import chart_options
    from chart_common import (CHART, DEPLOY, Results, by_kind, flag, objects, render,
                              render_objects)
except ImportError as error:
    print(f"skipped: deploy tools missing ({error}); scripts/bootstrap.sh --print-tools-python "
          "installs them")
    sys.exit(77)

MANIFESTS = DEPLOY / "manifests" / "tessera.yaml"
RULES = CHART / "files" / "alerts.rules.yaml"
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
    "TLS, auth file, join token, network policy": {
        "tls": {"enabled": True, "secretName": "tessera-tls"},
        "auth": {"secretName": "tessera-auth", "joinTokenSecret": "tessera-join"},
        "networkPolicy": {"enabled": True},
    },
    "TLS, workers by certificate": {
        "tls": {"enabled": True, "secretName": "tessera-tls"},
        "auth": {"secretName": "tessera-auth"},
    },
    "queues": {
        "queues": {"cohorts": [{"name": "lab"}],
                   "queues": [{"name": "nlp", "cohort": "lab", "nominal": {"gpus": 8},
                               "default_for": {"users": ["alice"]}},
                              {"name": "vision", "cohort": "lab", "nominal": {"gpus": 8}}],
                   "default_queue": "vision"},
    },
    "existing claim, CPU-only nodes": {
        "sharedStorage": {"existingClaim": "team-nfs"},
        # null drops the default GPU selector ({} would be merged with it).
        "worker": {"gpusPerNode": 0, "cpuSlots": 4, "nodeSelector": None, "tolerations": [],
                   "labels": {"pool": "cpu", "zone": "a"},
                   "topology": {"rack": "r17", "block": "b3"}},
        "coordinator": {"topologyLevels": "rack:200,block:50"},
        "grafana": {"dashboards": {"enabled": False}},
        "logFormat": "text",
    },
    **chart_options.VALUES_SETS,
    **chart_monitoring.VALUES_SETS,
    **chart_ha.VALUES_SETS,
}


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


def rules_text():
    """files/alerts.rules.yaml: the PrometheusRule's groups rendered with the default values."""
    objs = render_objects({"metrics": {"prometheusRule": {"enabled": True}}})
    groups = by_kind(objs, "PrometheusRule")[0]["spec"]["groups"]
    header = ("# Tessera's Prometheus alert rules, rendered from files/alerts.rules.tpl.yaml with "
              "the chart's\n# default values (release \"tessera\", namespace \"tessera\") by "
              "deploy/render.sh: edit the template,\n# not this file. For `rule_files:` in "
              "prometheus.yml; tested by deploy/prometheus/alerts_test.yaml.\n")
    order = ("alert", "expr", "for", "labels", "annotations")
    groups = [{"name": g["name"], "rules": [{k: r[k] for k in order if k in r} for r in g["rules"]]}
              for g in groups]

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value):  # expressions over several lines stay readable as blocks
        return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                       style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return header + yaml.dump({"groups": groups}, Dumper=Dumper, sort_keys=False, width=100,
                              allow_unicode=True)


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


def containers(objs):
    """{"coordinator": (pod spec, container), "worker": ...} of one render."""
    pods = {"coordinator": chart_ha.coordinator_of(objs)[0], "worker": by_kind(objs, "DaemonSet")[0]}
    return {name: (o["spec"]["template"]["spec"], o["spec"]["template"]["spec"]["containers"][0])
            for name, o in pods.items()}


def secret_behind(pod, container, path):
    """The Secret (and key) a file path reads, when it lies in a read-only whole-Secret mount."""
    directory, key = path.rsplit("/", 1)
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == directory]
    if len(mounts) != 1 or mounts[0].get("readOnly") is not True or "subPath" in mounts[0]:
        return None  # a subPath mount would never see a rotated file
    volumes = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    return (volumes[0]["secret"]["secretName"], key) if volumes and "secret" in volumes[0] else None


def configmap_behind(pod, container, path):
    """The ConfigMap (and key) a file path reads, when it lies in a read-only whole-map mount."""
    directory, key = path.rsplit("/", 1)
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == directory]
    if len(mounts) != 1 or mounts[0].get("readOnly") is not True or "subPath" in mounts[0]:
        return None  # a subPath mount would never see an updated file
    volumes = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    return (volumes[0]["configMap"]["name"], key) if volumes and "configMap" in volumes[0] else None


def test_security(results, rendered_sets):
    tls_flags = ("tls-cert", "tls-key", "tls-ca")
    for label, objs in rendered_sets.items():
        values = VALUES_SETS[label]
        tls = values.get("tls", {}).get("enabled", False)
        auth = values.get("auth", {})
        for daemon, (pod, container) in containers(objs).items():
            args = container["args"]
            where = f"{label}: {daemon}"
            probes = [container[p] for p in ("startupProbe", "livenessProbe", "readinessProbe")
                      if p in container]
            if not tls:
                results.check("--insecure" in args and not any(flag(container, f) for f in tls_flags),
                              f"{where}: plaintext only with --insecure (listens on 0.0.0.0)")
                results.check(all("grpc" in p for p in probes), f"{where}: gRPC health probes")
                continue
            results.check("--insecure" not in args, f"{where}: no --insecure under TLS")
            secrets = {f: secret_behind(pod, container, flag(container, f) or "/") for f in tls_flags}
            results.check(secrets == {"tls-cert": ("tessera-tls", "tls.crt"),
                                      "tls-key": ("tessera-tls", "tls.key"),
                                      "tls-ca": ("tessera-tls", "ca.crt")},
                          f"{where}: --tls-cert/--tls-key/--tls-ca read the kubernetes.io/tls "
                          "Secret's keys from a read-only mount", str(secrets))
            health = [p["containerPort"] for p in container["ports"] if p["name"] == "health"]
            results.check(probes and health and all(
                p.get("grpc", {}).get("port") == health[0] for p in probes)
                and flag(container, "health-listen") == f"0.0.0.0:{health[0]}",
                f"{where}: gRPC probes under TLS, on the plaintext health-only port "
                "(--health-listen; the grpc probe cannot do TLS)", str(probes))
        (coordinator_pod, coordinator), (worker_pod, worker) = containers(objs).values()
        if tls:
            # Workers are dialled by pod IP: their shared certificate is checked for the
            # coordinator Service's name, which it carries, instead.
            results.check(flag(coordinator, "worker-tls-name") == "tessera-coordinator",
                          f"{label}: --worker-tls-name names the shared certificate's DNS SAN",
                          str(flag(coordinator, "worker-tls-name")))
        else:
            results.check(flag(coordinator, "worker-tls-name") is None,
                          f"{label}: no --worker-tls-name without TLS")
        auth_file = flag(coordinator, "auth-file")
        if auth.get("secretName"):
            results.check(secret_behind(coordinator_pod, coordinator, auth_file or "/")
                          == (auth["secretName"], "auth.yaml"),
                          f"{label}: --auth-file reads auth.yaml from the auth Secret, read-only",
                          str(auth_file))
        else:
            results.check(auth_file is None, f"{label}: no --auth-file without auth.secretName")
        join = flag(worker, "join-token-file")
        if auth.get("joinTokenSecret"):
            results.check(secret_behind(worker_pod, worker, join or "/")
                          == (auth["joinTokenSecret"], "token"),
                          f"{label}: --join-token-file reads key token of the join Secret, "
                          "read-only", str(join))
        else:
            results.check(join is None, f"{label}: no --join-token-file without auth.joinTokenSecret")
        queue_file = flag(coordinator, "queue-file")
        if values.get("queues"):
            configmaps = {o["metadata"]["name"]: o for o in by_kind(objs, "ConfigMap")}
            behind = configmap_behind(coordinator_pod, coordinator, queue_file or "/")
            text = (configmaps.get(behind[0], {}).get("data", {}).get(behind[1])
                    if behind else None)
            results.check(text is not None and yaml.safe_load(text) == values["queues"],
                          f"{label}: --queue-file reads the values' queues from a read-only "
                          "ConfigMap mount", str(queue_file))
        else:
            results.check(queue_file is None, f"{label}: no --queue-file without queues")
        results.check(flag(worker, "auth-file") is None and flag(coordinator, "join-token-file") is None
                      and not any(v["name"] == "auth" for v in worker_pod["volumes"]),
                      f"{label}: the auth file stays on the coordinator, the join token on workers")

    # Under the NetworkPolicy only worker pods reach the workers' other ports (the trainers'
    # unauthenticated c10d TCPStore and NCCL/Gloo sockets); others get one named port each.
    for label, objs in rendered_sets.items():
        if not VALUES_SETS[label].get("networkPolicy", {}).get("enabled"):
            continue
        policies = {o["metadata"]["name"]: o["spec"] for o in by_kind(objs, "NetworkPolicy")}
        worker_policy = policies["tessera-worker"]
        worker_selector = worker_policy["podSelector"]["matchLabels"]
        open_rules = [r for r in worker_policy["ingress"] if not r.get("ports")]
        results.check(worker_policy["policyTypes"] == ["Ingress"] and len(open_rules) == 1 and
                      open_rules[0]["from"] == [{"podSelector": {"matchLabels": worker_selector}}],
                      f"{label}: workers take any port from worker pods only (trainer ports)",
                      str(worker_policy["ingress"]))
        ports = {p["port"] for r in worker_policy["ingress"] if r.get("ports") for p in r["ports"]}
        results.check(ports == {50052, 9465}, f"{label}: others reach only the worker's gRPC and "
                      "metrics ports", str(ports))
        coordinator_policy = policies["tessera-coordinator"]
        results.check(all(r.get("ports") for r in coordinator_policy["ingress"]) and
                      {p["port"] for r in coordinator_policy["ingress"] for p in r["ports"]}
                      == {50051, 9464},
                      f"{label}: the coordinator takes only its gRPC and metrics ports")


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
        RULES.write_text(rules_text())
        print(f"wrote {RULES}")
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
    results.check(container["livenessProbe"]["grpc"] == {"port": 50053}
                  and container["readinessProbe"]["grpc"]
                  == {"port": 50053, "service": "tessera.v1.Coordinator"}
                  and "--health-listen=0.0.0.0:50053" in container["args"],
                  "coordinator: live while the process serves, ready while tessera.v1.Coordinator "
                  "serves (the leader), on the health-only port", str(container["readinessProbe"]))
    results.check(coordinator["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"],
                  "coordinator: state on its own PVC")
    results.check("--log-format=json" in container["args"], "coordinator: JSON logs by default")
    worker = by_kind(default, "DaemonSet")[0]["spec"]["template"]["spec"]
    worker_container = worker["containers"][0]
    results.check(worker_container["resources"]["limits"].get("nvidia.com/gpu") == 8,
                  "worker: requests the node's GPUs")
    results.check("hostIPC" not in worker and any(
        v.get("emptyDir", {}).get("medium") == "Memory" for v in worker["volumes"]),
        "worker: a memory-backed /dev/shm for NCCL, without the host's IPC namespace")
    results.check(worker_container["livenessProbe"]["grpc"] == {"port": 50054}
                  and worker_container["readinessProbe"]["grpc"]
                  == {"port": 50054, "service": "tessera.v1.Worker"}
                  and "--health-listen=0.0.0.0:50054" in worker_container["args"],
                  "worker: live while the process serves, ready once tessera.v1.Worker serves "
                  "(after registering)", str(worker_container["readinessProbe"]))
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
    cpu_pod = by_kind(cpu, "DaemonSet")[0]["spec"]["template"]["spec"]
    cpu_worker = cpu_pod["containers"][0]
    results.check("nvidia.com/gpu" not in cpu_worker["resources"]["limits"]
                  and "nodeSelector" not in cpu_pod
                  and "--cpu-slots=4" in cpu_worker["args"]
                  and "--labels=pool=cpu,zone=a" in cpu_worker["args"]
                  and "--topology=block=b3,rack=r17" in cpu_worker["args"],
                  "CPU-only workers: no GPU request, CPU slots, labels and topology passed")
    cpu_coordinator = [d for d in by_kind(cpu, "Deployment") + by_kind(cpu, "StatefulSet")
                       if "coordinator" in d["metadata"]["name"]]
    results.check(bool(cpu_coordinator) and "--topology-levels=rack:200,block:50" in
                  cpu_coordinator[0]["spec"]["template"]["spec"]["containers"][0]["args"],
                  "the coordinator gets the topology levels")
    results.check(not by_kind(cpu, "PersistentVolumeClaim"), "an existing claim is not created")

    test_security(results, rendered_sets)
    chart_options.test_hatches(results, rendered_sets["escape hatches"])
    chart_options.test_groups(results, rendered_sets["worker groups"])
    chart_options.test_work_dir_and_storage(results, default,
                                            rendered_sets["kind (values-kind.yaml)"])
    chart_options.test_pod_security(results, default)
    chart_options.test_refusals(results)
    chart_lifecycle.test_upgrade(results)
    chart_lifecycle.test_upgrade_notes(results)
    chart_lifecycle.test_names(results)
    for label, values in (("defaults", {}), ("values-kind.yaml", chart_options.KIND_VALUES)):
        report = lint(str(CHART), values, strict=True, namespace="tessera")
        problems = report["errors"] + [m for m in report["messages"] if m["severity"] > 1]
        results.check(not problems, f"helm lint --strict ({label}): no warning or error",
                      str(problems))

    # The values schema refuses mistakes.
    for label, bad, why in (("a typo", {"coordinatr": {"grpcPort": 1}}, "'coordinatr' not allowed"),
                            ("a wrong type", {"worker": {"gpusPerNode": "eight"}}, "/worker/gpusPerNode"),
                            ("a bad duration", {"coordinator": {"heartbeatTimeout": "soon"}},
                             "/coordinator/heartbeatTimeout"),
                            ("a typo in tls", {"tls": {"enabeld": True}}, "'enabeld' not allowed"),
                            ("a typo in auth", {"auth": {"joinTokenSecrets": "t"}},
                             "'joinTokenSecrets' not allowed"),
                            ("TLS without a Secret", {"tls": {"enabled": True}}, "/tls/secretName"),
                            ("a Secret name Kubernetes refuses", {"auth": {"secretName": "Auth_File"}},
                             "/auth/secretName")):
        try:
            render(bad)
            results.check(False, f"values schema refuses {label}", "rendered")
        except HelmError as error:
            results.check(why in str(error), f"values schema refuses {label}, naming it", str(error))

    try:
        render({"auth": {"secretName": "tessera-auth"}})
        results.check(False, "an auth file without TLS or a join token is refused", "rendered")
    except HelmError as error:
        results.check("auth.joinTokenSecret" in str(error),
                      "an auth file without TLS or a join token is refused (workers could not "
                      "authenticate)", str(error))

    # The plain manifests are the chart's default render.
    fresh = manifest_text(render({}))
    results.check(MANIFESTS.exists() and MANIFESTS.read_text() == fresh,
                  f"{MANIFESTS.name} equals a fresh render (deploy/render.sh)")

    results.check(RULES.exists() and RULES.read_text() == rules_text(),
                  f"{RULES.name} equals a fresh render of the rules template (deploy/render.sh)")
    chart_monitoring.test_monitoring(results)
    chart_ha.test_ha(results, rendered_sets)

    for name in results.passed:
        print(f"PASS {name}")
    for name in results.failed:
        print(f"FAIL {name}")
    print(f"{len(results.passed)} passed, {len(results.failed)} failed")
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
