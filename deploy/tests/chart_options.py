"""The chart's escape hatches, worker groups, work directory, storage and kind values
(chart_test.py renders and validates the values sets here, then runs these checks).
"""
import yaml

from chart_common import CHART, by_kind, flag, render_objects
from helm_python.errors import HelmError

KIND_VALUES = yaml.safe_load((CHART / "values-kind.yaml").read_text())

HATCHES = {
    "extraArgs": ["--extra-flag=1"],
    "extraEnv": [{"name": "EXTRA", "value": "1"},
                 {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    "envFrom": [{"configMapRef": {"name": "tessera-env"}}],
    "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "podAnnotations": {"example.com/note": "hatch"},
    "podLabels": {"team": "research"},
    "priorityClassName": "training-high",
    "runtimeClassName": "nvidia",
    "addCapabilities": ["IPC_LOCK"],
    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
}

GROUPS = [
    {"name": "h100x8", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
     "labels": {"gpu": "h100"}},
    {"name": "l4x4", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}, "gpusPerNode": 4,
     "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "128Gi"}},
     "labels": {"gpu": "l4"}, "priorityClassName": "inference-low"},
    {"name": "cpu", "gpusPerNode": 0, "cpuSlots": 8, "nodeSelector": {}, "tolerations": [],
     "workDir": {"hostPath": ""}},
]

# Added to chart_test.py's VALUES_SETS: each is rendered and every object validated (strict).
VALUES_SETS = {
    "escape hatches": {"coordinator": HATCHES,
                       "worker": {**HATCHES, "hostNetwork": True,
                                  "updateStrategy": {"type": "RollingUpdate",
                                                     "rollingUpdate": {"maxUnavailable": 2}}}},
    "worker groups": {"worker": {"groups": GROUPS},
                      "metrics": {"podMonitor": {"enabled": True}},
                      "networkPolicy": {"enabled": True}},
    "kind (values-kind.yaml)": KIND_VALUES,
}

REFUSED = (
    ("a typo in a worker escape hatch", {"worker": {"extraEnvs": []}}, "'extraEnvs' not allowed"),
    ("a typo in a coordinator escape hatch", {"coordinator": {"podAnotations": {}}},
     "'podAnotations' not allowed"),
    ("hostNetwork on the coordinator", {"coordinator": {"hostNetwork": True}},
     "'hostNetwork' not allowed"),
    ("an env var without a name", {"worker": {"extraEnv": [{"value": "1"}]}}, "/worker/extraEnv/0"),
    ("extraArgs as a string", {"coordinator": {"extraArgs": "--x=1"}}, "/coordinator/extraArgs"),
    ("a volume mount without a path", {"worker": {"extraVolumeMounts": [{"name": "v"}]}},
     "/worker/extraVolumeMounts/0"),
    ("a lower-case capability", {"worker": {"addCapabilities": ["ipc_lock"]}},
     "/worker/addCapabilities/0"),
    ("hostNetwork as a string", {"worker": {"hostNetwork": "yes"}}, "/worker/hostNetwork"),
    ("an unknown update strategy", {"worker": {"updateStrategy": {"type": "Rolling"}}},
     "/worker/updateStrategy/type"),
    ("a pod label replacing a selector label",
     {"worker": {"podLabels": {"app.kubernetes.io/component": "x"}}},
     "invalid propertyName 'app.kubernetes.io/component'"),
    ("a pod label value over 63 characters", {"coordinator": {"podLabels": {"a": "x" * 64}}},
     "/coordinator/podLabels/a"),
    ("a priority class name with capitals", {"worker": {"priorityClassName": "High"}},
     "/worker/priorityClassName"),
    ("a typo in a worker group", {"worker": {"groups": [{"name": "a", "gpusPerNodes": 4}]}},
     "'gpusPerNodes' not allowed"),
    ("a worker group without a name", {"worker": {"groups": [{"gpusPerNode": 4}]}},
     "missing property 'name'"),
    ("a worker group name over 15 characters", {"worker": {"groups": [{"name": "a" * 16}]}},
     "/worker/groups/0/name"),
    ("a worker group name with capitals", {"worker": {"groups": [{"name": "H100"}]}},
     "/worker/groups/0/name"),
    ("a port per worker group", {"worker": {"groups": [{"name": "a", "grpcPort": 1}]}},
     "'grpcPort' not allowed"),
    ("a wrong type in a worker group", {"worker": {"groups": [{"name": "a", "cpuSlots": "2"}]}},
     "/worker/groups/0/cpuSlots"),
    ("an unknown access mode", {"sharedStorage": {"accessModes": ["ReadWriteSome"]}},
     "/sharedStorage/accessModes/0"),
    ("a relative work directory", {"worker": {"workDir": {"hostPath": "var/lib"}}},
     "/worker/workDir/hostPath"),
)


def pod_and_container(obj):
    pod = obj["spec"]["template"]["spec"]
    return obj["spec"]["template"], pod, pod["containers"][0]


def test_hatches(results, objs):
    coordinator = by_kind(objs, "StatefulSet")[0]
    worker = by_kind(objs, "DaemonSet")[0]
    for daemon, obj in (("coordinator", coordinator), ("worker", worker)):
        template, pod, container = pod_and_container(obj)
        where = f"escape hatches: {daemon}"
        results.check(container["args"][-1] == "--extra-flag=1",
                      f"{where}: extraArgs after the chart's flags")
        env = {e["name"]: e for e in container.get("env", [])}
        results.check(env.get("EXTRA") == {"name": "EXTRA", "value": "1"}
                      and "secretKeyRef" in env.get("FROM_SECRET", {}).get("valueFrom", {}),
                      f"{where}: extraEnv in the container's env", str(env))
        results.check(container.get("envFrom") == HATCHES["envFrom"], f"{where}: envFrom")
        results.check({"name": "scratch", "emptyDir": {}} in pod["volumes"]
                      and {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"],
                      f"{where}: extraVolumes and extraVolumeMounts")
        results.check(template["metadata"].get("annotations") == HATCHES["podAnnotations"]
                      and template["metadata"]["labels"].get("team") == "research"
                      and template["metadata"]["labels"]["app.kubernetes.io/component"] == daemon,
                      f"{where}: podAnnotations and podLabels beside the selector labels")
        results.check(pod.get("priorityClassName") == "training-high"
                      and pod.get("runtimeClassName") == "nvidia",
                      f"{where}: priorityClassName and runtimeClassName")
        capabilities = container["securityContext"]["capabilities"]
        results.check(capabilities == {"drop": ["ALL"], "add": ["IPC_LOCK"]},
                      f"{where}: only the added capability on top of drop ALL", str(capabilities))
        results.check(container["resources"]["limits"]["memory"] == "8Gi"
                      and container["resources"]["requests"]["cpu"] == "2",
                      f"{where}: resources", str(container["resources"]))
    _, pod, container = pod_and_container(worker)
    results.check(pod.get("hostNetwork") is True
                  and pod.get("dnsPolicy") == "ClusterFirstWithHostNet",
                  "escape hatches: worker hostNetwork with ClusterFirstWithHostNet DNS")
    results.check(worker["spec"]["updateStrategy"] == VALUES_SETS["escape hatches"]["worker"]
                  ["updateStrategy"], "escape hatches: the worker updateStrategy is a value")
    _, pod, _ = pod_and_container(coordinator)
    results.check("hostNetwork" not in pod, "escape hatches: the coordinator keeps the pod network")


def test_groups(results, objs):
    daemonsets = {d["metadata"]["name"]: d for d in by_kind(objs, "DaemonSet")}
    results.check(sorted(daemonsets) == ["tessera-worker-cpu", "tessera-worker-h100x8",
                                         "tessera-worker-l4x4"],
                  "worker groups: one DaemonSet per group, named after it", str(sorted(daemonsets)))
    selectors = {n: d["spec"]["selector"]["matchLabels"] for n, d in daemonsets.items()}
    results.check(len({tuple(sorted(s.items())) for s in selectors.values()}) == 3
                  and all(s.get("tessera/worker-group") == n.rsplit("-", 1)[1]
                          for n, s in selectors.items()),
                  "worker groups: each DaemonSet selects its own group's pods", str(selectors))
    pods = {n: pod_and_container(d) for n, d in daemonsets.items()}
    h100, l4, cpu = (pods[f"tessera-worker-{g}"] for g in ("h100x8", "l4x4", "cpu"))
    results.check(h100[2]["resources"]["limits"]["nvidia.com/gpu"] == 8
                  and h100[2]["resources"]["requests"]["cpu"] == "8"
                  and {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                  in h100[1]["tolerations"],
                  "worker groups: a group takes the worker defaults it does not set")
    results.check(h100[1]["nodeSelector"] == GROUPS[0]["nodeSelector"],
                  "worker groups: a group's nodeSelector replaces the default one whole",
                  str(h100[1]["nodeSelector"]))
    results.check(l4[2]["resources"]["limits"] == {"memory": "128Gi", "nvidia.com/gpu": 4}
                  and l4[1].get("priorityClassName") == "inference-low"
                  and "--labels=gpu=l4" in l4[2]["args"],
                  "worker groups: a group's GPUs, resources, labels and escape hatches",
                  str(l4[2]["resources"]))
    results.check("nodeSelector" not in cpu[1] and "tolerations" not in cpu[1]
                  and "nvidia.com/gpu" not in cpu[2]["resources"].get("limits", {})
                  and "--cpu-slots=8" in cpu[2]["args"]
                  and {"name": "work", "emptyDir": {}} in cpu[1]["volumes"],
                  "worker groups: a CPU group without GPU selector, tolerations or GPU request")
    # Everything that selects workers of any group (Service, NetworkPolicy, PodMonitor) selects
    # each group's pods.
    selecting = [by_kind(objs, "Service"), by_kind(objs, "NetworkPolicy"),
                 by_kind(objs, "PodMonitor")]
    worker_selectors = [s["spec"]["selector"] for s in selecting[0]
                        if s["metadata"]["name"] == "tessera-worker"]
    worker_selectors += [p["spec"]["podSelector"]["matchLabels"] for p in selecting[1]
                         if p["metadata"]["name"] == "tessera-worker"]
    worker_selectors += [m["spec"]["selector"]["matchLabels"] for m in selecting[2]]
    results.check(len(worker_selectors) == 3 and all(
        set(s.items()) <= set(pod[0]["metadata"]["labels"].items())
        for s in worker_selectors for pod in pods.values()),
        "worker groups: the worker Service, NetworkPolicy and PodMonitor select every group",
        str(worker_selectors))
    try:
        render_objects({"worker": {"groups": [{"name": "a"}, {"name": "a"}]}})
        results.check(False, "two worker groups of one name are refused", "rendered")
    except HelmError as error:
        results.check('two groups are named "a"' in str(error),
                      "two worker groups of one name are refused", str(error))


def test_work_dir_and_storage(results, default, kind):
    worker = by_kind(default, "DaemonSet")[0]
    _, pod, container = pod_and_container(worker)
    work_dir = flag(container, "work-dir")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    work = volumes.get(mounts.get(work_dir), {})
    results.check(work.get("hostPath") == {"path": "/var/lib/tessera/tessera/tessera",
                                           "type": "DirectoryOrCreate"},
                  "worker: --work-dir is a directory of the node, per namespace and release (the "
                  "node key outlives the pod)", str(work))
    init = pod.get("initContainers", [])
    results.check(len(init) == 1 and {"name": mounts[work_dir], "mountPath": work_dir}
                  in init[0]["volumeMounts"] and "chown 10001:10001" in init[0]["command"][-1],
                  "worker: an init container gives the work directory to the worker's user")
    home = volumes.get(mounts.get("/var/lib/tessera"), {})
    results.check("emptyDir" in home and "/tmp" in mounts,
                  "worker: a writable home and /tmp under the read-only root file system")
    plain = render_objects({"worker": {"workDir": {"hostPath": ""}}})
    _, pod, container = pod_and_container(by_kind(plain, "DaemonSet")[0])
    results.check({"name": "work", "emptyDir": {}} in pod["volumes"]
                  and "initContainers" not in pod
                  and not any("hostPath" in v for v in pod["volumes"]),
                  "worker: workDir.hostPath \"\" puts the work directory on an emptyDir, "
                  "no hostPath, no root init container")

    coordinator = by_kind(default, "StatefulSet")[0]["spec"]["template"]["spec"]
    results.check(not any("persistentVolumeClaim" in v for v in coordinator["volumes"]),
                  "coordinator: starts without the shared claim (it only passes the path on)")
    results.check(flag(coordinator["containers"][0], "checkpoint-root") == "/shared/checkpoints",
                  "coordinator: --checkpoint-root is the workers' shared mount")

    # values-kind.yaml: what a single-node kind cluster can run.
    claims = by_kind(kind, "PersistentVolumeClaim")
    results.check(len(claims) == 1 and claims[0]["spec"]["accessModes"] == ["ReadWriteOnce"]
                  and "storageClassName" not in claims[0]["spec"],
                  "kind: the shared claim is ReadWriteOnce on the default StorageClass")
    _, pod, container = pod_and_container(by_kind(kind, "DaemonSet")[0])
    results.check("nodeSelector" not in pod and "tolerations" not in pod
                  and "nvidia.com/gpu" not in str(container["resources"])
                  and "--cpu-slots=2" in container["args"],
                  "kind: CPU workers on any node, two slots, no GPU request",
                  str(pod.get("nodeSelector")))
    images = {c["image"] + " " + c["imagePullPolicy"] for o in kind
              if o["kind"] in ("StatefulSet", "DaemonSet")
              for c in o["spec"]["template"]["spec"]["containers"]
              + o["spec"]["template"]["spec"].get("initContainers", [])}
    results.check(images == {"tessera:dev Never"}, "kind: the image loaded into kind, never pulled",
                  str(images))


# Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards), the
# rules a pod of this chart could break; `kubectl label ns tessera
# pod-security.kubernetes.io/enforce=LEVEL` makes the API server apply them.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def pod_security_violations(pod, level):
    """What in a pod spec the Pod Security level ("baseline" or "restricted") refuses."""
    found = [f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    found += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    every = pod["containers"] + pod.get("initContainers", [])
    for c in every:
        context = c.get("securityContext", {})
        added = set(context.get("capabilities", {}).get("add", []))
        if context.get("privileged"):
            found.append(f"{c['name']}: privileged")
        if added - BASELINE_CAPABILITIES:
            found.append(f"{c['name']}: adds {sorted(added - BASELINE_CAPABILITIES)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{c['name']}: hostPort")
    if level == "baseline":
        return found
    found += [f"volume {v['name']}: not a restricted type" for v in pod.get("volumes", [])
              if not set(v) - {"name"} <= RESTRICTED_VOLUMES and "hostPath" not in v]
    pod_context = pod.get("securityContext", {})
    if pod_context.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        found.append("seccompProfile")
    for c in every:
        context = {**pod_context, **c.get("securityContext", {})}
        capabilities = context.get("capabilities", {})
        if context.get("runAsNonRoot") is not True or context.get("runAsUser") == 0:
            found.append(f"{c['name']}: may run as root")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{c['name']}: allowPrivilegeEscalation")
        if "ALL" not in capabilities.get("drop", []) or \
                set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{c['name']}: capabilities beyond NET_BIND_SERVICE")
    return found


def test_pod_security(results, default):
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in default
            if o["kind"] in ("StatefulSet", "DaemonSet")}
    coordinator, worker = pods["tessera-coordinator"], pods["tessera-worker"]
    results.check(not pod_security_violations(coordinator, "restricted"),
                  "Pod Security: the coordinator meets \"restricted\"",
                  str(pod_security_violations(coordinator, "restricted")))
    results.check(pod_security_violations(worker, "baseline") == ["volume work: hostPath"],
                  "Pod Security: the default worker breaks \"baseline\" only by its hostPath work "
                  "directory (no hostIPC)", str(pod_security_violations(worker, "baseline")))
    plain = render_objects({"worker": {"workDir": {"hostPath": ""}}})
    worker = by_kind(plain, "DaemonSet")[0]["spec"]["template"]["spec"]
    results.check(not pod_security_violations(worker, "restricted"),
                  "Pod Security: with workDir.hostPath \"\" the worker meets \"restricted\"",
                  str(pod_security_violations(worker, "restricted")))


def test_refusals(results):
    for label, bad, why in REFUSED:
        try:
            render_objects(bad)
            results.check(False, f"values schema refuses {label}", "rendered")
        except HelmError as error:
            results.check(why in str(error), f"values schema refuses {label}, naming it",
                          str(error))
