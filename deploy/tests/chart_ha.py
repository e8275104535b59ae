"""Several coordinators on PostgreSQL (coordinator.replicas, database.*; deploy/README.md, "HA
control plane"): chart_test.py renders and validates the values sets here, then runs these checks.
"""
from chart_common import CHART, DEFAULT_RELEASE, by_kind, flag, render_objects
from chart_options import pod_security_violations
from helm_python.chart import Chart
from helm_python.errors import HelmError

URL = "postgresql://app@tessera-pg-rw.db.svc:5432/app?sslmode=require"
DATABASE = {"url": URL, "existingSecret": "tessera-pg-app"}

# Added to chart_test.py's VALUES_SETS: each is rendered and every object validated (strict).
VALUES_SETS = {
    "HA: three coordinators on PostgreSQL": {
        "coordinator": {"replicas": 3}, "database": DATABASE,
        "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
        "networkPolicy": {"enabled": True},
    },
    "HA: two coordinators, TLS, one per node": {
        "coordinator": {"replicas": 2, "podAntiAffinity": "required", "leaderLeaseSeconds": 10},
        "database": {**DATABASE, "passwordKey": "pw"},
        "tls": {"enabled": True, "secretName": "tessera-tls"},
    },
    "HA: the user's own affinity": {
        "coordinator": {"replicas": 2, "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "pool", "operator": "In",
                                       "values": ["control"]}]}]}}}},
        "database": DATABASE,
    },
    "one coordinator on PostgreSQL": {"database": DATABASE},
}

REFUSED = (
    ("two coordinators on SQLite", {"coordinator": {"replicas": 2}},
     "coordinator.replicas is 2, but several coordinators need their state in PostgreSQL: set "
     "database.url"),
    ("a password in database.url",
     {"database": {"url": "postgresql://app:secret@pg/app", "existingSecret": "s"}},
     "database.url carries a password"),
    ("a password parameter in database.url",
     {"database": {"url": "postgresql://app@pg/app?password=secret", "existingSecret": "s"}},
     "database.url carries a password parameter"),
    ("database.url without its Secret", {"coordinator": {"replicas": 2},
                                         "database": {"url": URL}},
     "database.url is set but database.existingSecret is empty"),
    ("zero coordinators", {"coordinator": {"replicas": 0}}, "/coordinator/replicas"),
    ("a URL that is not PostgreSQL's", {"database": {"url": "mysql://app@db/app",
                                                     "existingSecret": "s"}}, "/database/url"),
    ("an unknown anti-affinity", {"coordinator": {"podAntiAffinity": "soft"}},
     "/coordinator/podAntiAffinity"),
    ("a typo in database", {"database": {"existingSecrets": "s"}}, "'existingSecrets' not allowed"),
    ("an empty password key", {"database": {"passwordKey": ""}}, "/database/passwordKey"),
)


def coordinator_of(objs):
    """The coordinator's controller, pod spec and container."""
    controller = [o for o in objs if o["kind"] in ("StatefulSet", "Deployment")
                  and o["metadata"]["name"].endswith("-coordinator")][0]
    pod = controller["spec"]["template"]["spec"]
    return controller, pod, pod["containers"][0]


def selects(selector, template):
    return set(selector.items()) <= set(template["metadata"]["labels"].items())


def test_ha_set(results, label, objs, values):
    controller, pod, container = coordinator_of(objs)
    coordinator_values = values.get("coordinator", {})
    replicas = coordinator_values.get("replicas", 1)
    where = f"{label}: coordinator"
    results.check(controller["kind"] == "Deployment" and controller["spec"]["replicas"] == replicas
                  and not by_kind(objs, "StatefulSet"),
                  f"{where}: a Deployment of coordinator.replicas pods, no StatefulSet",
                  f"{controller['kind']} {controller['spec'].get('replicas')}")
    results.check(controller["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "100%"}},
        f"{where}: an update replaces every pod at once (a standby is never Ready, so a rolling "
        "update that waits for one would never end)", str(controller["spec"]["strategy"]))
    claims = [c["metadata"]["name"] for c in by_kind(objs, "PersistentVolumeClaim")]
    results.check(claims == ["tessera-shared"]
                  and not any("persistentVolumeClaim" in v for v in pod["volumes"])
                  and flag(container, "state") == URL,
                  f"{where}: --state is database.url, no claim for state", str(claims))
    password = flag(container, "database-password-file") or "/"
    directory, key = password.rsplit("/", 1)
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = (volumes.get(mounts[0]["name"], {}).get("secret", {}).get("secretName")
              if len(mounts) == 1 and mounts[0].get("readOnly") is True else None)
    expected_key = values["database"].get("passwordKey", "password")
    results.check(secret == values["database"]["existingSecret"] and key == expected_key
                  and not any(URL in str(e) for e in container.get("env", [])),
                  f"{where}: --database-password-file reads database.passwordKey of "
                  "database.existingSecret from a read-only mount", password)
    env = {e["name"]: e for e in container.get("env", [])}
    results.check(flag(container, "advertise-address") == "$(POD_IP):50051"
                  and env.get("POD_IP", {}).get("valueFrom")
                  == {"fieldRef": {"fieldPath": "status.podIP"}},
                  f"{where}: advertises its pod IP (downward API) and gRPC port",
                  str(flag(container, "advertise-address")))
    lease = coordinator_values.get("leaderLeaseSeconds", 5)
    results.check(flag(container, "leader-lease-seconds") == str(lease),
                  f"{where}: --leader-lease-seconds is coordinator.leaderLeaseSeconds")
    results.check(container["readinessProbe"]["grpc"] == {"port": 50053,
                                                          "service": "tessera.v1.Coordinator"}
                  and container["livenessProbe"]["grpc"] == {"port": 50053},
                  f"{where}: ready only while tessera.v1.Coordinator serves (the leader), live "
                  "while the process does (standbys too)", str(container["readinessProbe"]))
    results.check(not pod_security_violations(pod, "restricted"),
                  f"{where}: meets Pod Security \"restricted\"",
                  str(pod_security_violations(pod, "restricted")))

    services = {s["metadata"]["name"]: s for s in by_kind(objs, "Service")}
    service = services.get("tessera-coordinator", {}).get("spec", {})
    results.check(selects(service.get("selector", {}), controller["spec"]["template"])
                  and not service.get("publishNotReadyAddresses")
                  and "tessera-coordinator-headless" not in services,
                  f"{label}: the coordinator Service routes to Ready pods only (the leader), no "
                  "headless Service", str(service))
    _, _, worker = (lambda d: (d, d["spec"]["template"]["spec"],
                               d["spec"]["template"]["spec"]["containers"][0]))(
        by_kind(objs, "DaemonSet")[0])
    results.check(flag(worker, "coordinator") == "tessera-coordinator.tessera.svc:50051"
                  and {"name": "grpc", "port": 50051, "targetPort": "grpc", "appProtocol": "grpc"}
                  in service.get("ports", []),
                  f"{label}: workers dial the coordinator Service", str(flag(worker, "coordinator")))

    budgets = by_kind(objs, "PodDisruptionBudget")
    if replicas > 1:
        spec = budgets[0]["spec"] if len(budgets) == 1 else {}
        results.check(spec.get("maxUnavailable") == replicas
                      and selects(spec.get("selector", {}).get("matchLabels", {}),
                                  controller["spec"]["template"]),
                      f"{label}: a PodDisruptionBudget over the coordinators that lets a drain "
                      "evict the leader (only it is Ready)", str(spec))
    else:
        results.check(not budgets, f"{label}: no PodDisruptionBudget for one coordinator")

    affinity = pod.get("affinity", {})
    user_affinity = coordinator_values.get("affinity")
    if user_affinity:
        results.check(affinity == user_affinity,
                      f"{where}: coordinator.affinity replaces the chart's spread", str(affinity))
    elif replicas > 1:
        anti = affinity.get("podAntiAffinity", {})
        if coordinator_values.get("podAntiAffinity") == "required":
            terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        else:
            terms = [t["podAffinityTerm"] for t in
                     anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
        results.check(len(anti) == 1 and len(terms) == 1
                      and terms[0]["topologyKey"] == "kubernetes.io/hostname"
                      and selects(terms[0]["labelSelector"]["matchLabels"],
                                  controller["spec"]["template"]),
                      f"{where}: spread over nodes ({values['coordinator'].get('podAntiAffinity', 'preferred')})",
                      str(affinity))
    else:
        results.check("affinity" not in pod, f"{where}: no spread for one coordinator")


def test_ha(results, rendered_sets):
    for label, values in VALUES_SETS.items():
        test_ha_set(results, label, rendered_sets[label], values)
    # One coordinator on SQLite keeps its StatefulSet, claim and headless Service, and none of
    # the PostgreSQL flags.
    default = rendered_sets["defaults"]
    controller, pod, container = coordinator_of(default)
    results.check(controller["kind"] == "StatefulSet" and controller["spec"]["replicas"] == 1
                  and flag(container, "state") == "/var/lib/tessera/coordinator.db"
                  and not any(flag(container, f) for f in ("advertise-address",
                                                           "database-password-file",
                                                           "leader-lease-seconds"))
                  and "affinity" not in pod and not by_kind(default, "PodDisruptionBudget"),
                  "SQLite: one coordinator in a StatefulSet on its claim, no PostgreSQL flags")
    for label, values, expected in (("HA: three coordinators on PostgreSQL", None, True),
                                    ("defaults", {}, False)):
        with Chart.load(str(CHART)) as chart:
            rendered = chart.render(values=VALUES_SETS.get(label, values), **DEFAULT_RELEASE)
        notes = [text for path, text in rendered.items() if path.endswith("NOTES.txt")]
        results.check(len(notes) == 1 and ("3 coordinators on PostgreSQL: one leads" in notes[0])
                      == expected,
                      f"{label}: the install notes {'explain' if expected else 'omit'} the "
                      "standbys that are never Ready")
    for label, bad, why in REFUSED:
        try:
            render_objects(bad)
            results.check(False, f"refuses {label}", "rendered")
        except HelmError as error:
            results.check(why in str(error), f"refuses {label}, naming the value", str(error))
