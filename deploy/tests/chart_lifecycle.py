"""The chart's life across `helm upgrade` and release names (chart_test.py runs these).

- An upgrade to a new chart version must not touch what the API server refuses to change
  (selectors, a StatefulSet's serviceName, volumeClaimTemplates and podManagementPolicy, a
  Service's clusterIP and type, a claim's spec), nor rename an object (a renamed StatefulSet is a
  new one with a new, empty state claim).
- Pods roll only when what they run changes: the pod templates of two chart versions are equal
  when the image is the same, and the workers' differ when the image tag changes.
- Every object's name is a DNS label of at most 63 characters for any release name Helm takes
  (up to 53 characters, dots, a leading digit), also with worker groups of the longest name.
"""
import re
import tempfile

from chart_common import CHART, by_kind, render_objects, versioned_copy
from helm_python.chart import Chart

VERSION_LABELS = ("helm.sh/chart", "app.kubernetes.io/version")

# What an upgrade is checked with: each values set with the image pinned (a new appVersion would
# otherwise be a new image), rendered by the chart as it is and as a later version.
UPGRADE_VALUES = {
    "defaults": {},
    "TLS and auth": {"tls": {"enabled": True, "secretName": "tessera-tls"},
                     "auth": {"secretName": "tessera-auth", "joinTokenSecret": "tessera-join"},
                     "networkPolicy": {"enabled": True}},
    "worker groups": {"worker": {"groups": [{"name": "h100", "labels": {"gpu": "h100"}},
                                            {"name": "l4", "gpusPerNode": 4}]}},
}

# The longest release name Helm accepts is 53 characters.
LONG_RELEASES = {
    "tessera": "the chart's name",
    "prod-tessera-eu": "a release name containing the chart's name",
    "team-research-cluster-europe-west4-a": "36 characters",
    "research-training-cluster-europe-west4-production-01": "53 characters",
    "research-training-cluster-europe-west4-production-02": "53 characters, same beginning",
    "tessera-research-training-cluster-europe-west4-prod1": "53 characters containing tessera",
    "7.research.eu": "dots and a leading digit",
}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
EVERYTHING = {
    "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                "prometheusRule": {"enabled": True}},
    "networkPolicy": {"enabled": True},
    "worker": {"groups": [{"name": "a" * 15}, {"name": "b"}]},
}


def immutable_fields(objs):
    """{(kind, name): fields the API server will not change} of one render."""
    fields = {}
    for obj in objs:
        spec, key = obj.get("spec", {}), (obj["kind"], obj["metadata"]["name"])
        if obj["kind"] == "StatefulSet":
            fields[key] = {k: spec.get(k) for k in ("selector", "serviceName",
                                                    "volumeClaimTemplates", "podManagementPolicy")}
        elif obj["kind"] in ("DaemonSet", "Deployment"):
            fields[key] = {"selector": spec.get("selector")}
        elif obj["kind"] == "Service":
            fields[key] = {k: spec.get(k) for k in ("clusterIP", "type", "selector")}
        elif obj["kind"] == "PersistentVolumeClaim":
            fields[key] = spec
    return fields


def pod_templates(objs):
    return {(o["kind"], o["metadata"]["name"]): o["spec"]["template"] for o in objs
            if o["kind"] in ("StatefulSet", "DaemonSet", "Deployment")}


def differences(a, b, path=""):
    """Paths at which two YAML trees differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in differences(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    return [] if a == b else [path or "/"]


def version_labels_in(tree, path=""):
    """Paths of the version labels anywhere below `tree`."""
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in VERSION_LABELS:
                found.append(f"{path}/{key}")
            found += version_labels_in(value, f"{path}/{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            found += version_labels_in(value, f"{path}/{i}")
    return found


def test_upgrade(results):
    with tempfile.TemporaryDirectory() as directory:
        later = versioned_copy(directory, "0.9.0-rc.1+build.7", "0.9.0")
        for label, values in UPGRADE_VALUES.items():
            pinned = {**values, "image": {"repository": "ghcr.io/example/tessera", "tag": "0.1.0"}}
            now, bumped = render_objects(pinned), render_objects(pinned, chart=later)
            where = f"upgrade to a new chart version ({label})"
            labels_changed = [o["metadata"]["name"] for o in bumped
                              if o["metadata"]["labels"].get("helm.sh/chart") != "tessera-0.9.0-rc.1_build.7"]
            results.check(not labels_changed, f"{where}: objects' own labels carry the new version",
                          str(labels_changed))
            before, after = immutable_fields(now), immutable_fields(bumped)
            results.check(set(before) == set(after), f"{where}: no object renamed",
                          str(set(before) ^ set(after)))
            changed = {k: differences(before[k], after[k]) for k in before if k in after
                       and before[k] != after[k]}
            results.check(not changed, f"{where}: every immutable field unchanged (selectors, "
                          "serviceName, volumeClaimTemplates, podManagementPolicy, Service "
                          "clusterIP/type, claim spec)", str(changed))
            changed = {k: differences(v, pod_templates(bumped).get(k))
                       for k, v in pod_templates(now).items() if v != pod_templates(bumped).get(k)}
            results.check(not changed, f"{where}: pod templates unchanged (no pod rolls)",
                          str(changed))
            daemonsets = by_kind(now, "DaemonSet")
            results.check(daemonsets and all(d["spec"]["updateStrategy"] == {"type": "OnDelete"}
                                             for d in daemonsets),
                          f"{label}: workers are replaced only when deleted (OnDelete)")
            stuck = [(o["kind"], o["metadata"]["name"], p) for o in now for p in version_labels_in(
                {"selector": o.get("spec", {}).get("selector"),
                 "template": o.get("spec", {}).get("template"),
                 "volumeClaimTemplates": o.get("spec", {}).get("volumeClaimTemplates")})]
            results.check(not stuck, f"{label}: no version label in a selector, pod template or "
                          "volumeClaimTemplate", str(stuck))

        # A new appVersion with the default tag, or a new tag, is a new image: the workers'
        # templates change in the image only, immutable fields still do not.
        now = render_objects({})
        for label, objs in (("a new appVersion (default image tag)",
                             render_objects({}, chart=later)),
                            ("a new image.tag", render_objects({"image": {"tag": "0.1.1"}}))):
            results.check(immutable_fields(objs) == immutable_fields(now),
                          f"{label}: every immutable field unchanged")
            before, after = pod_templates(now), pod_templates(objs)
            workers = [k for k in before if k[0] == "DaemonSet"]
            changed = {k: differences(before[k], after[k]) for k in workers}
            results.check(workers and all(changed[k] and all(p.endswith("/image") for p in changed[k])
                                          for k in workers),
                          f"{label}: the worker pod template changes, in its images only",
                          str(changed))


def test_upgrade_notes(results):
    """After `helm upgrade`, the notes say how to move each node to the new pod template."""
    with Chart.load(str(CHART)) as chart:
        notes = {kind: chart.render(values={}, name="tessera", namespace="tessera",
                                    is_upgrade=kind == "upgrade", is_install=kind == "install")
                 ["tessera/templates/NOTES.txt"] for kind in ("install", "upgrade")}
    results.check("tessera nodes drain NODE --checkpoint" in notes["upgrade"]
                  and "tessera nodes undrain NODE" in notes["upgrade"]
                  and "nodes drain" not in notes["install"],
                  "helm upgrade's notes give the node-by-node worker procedure (not install's)")


def test_names(results):
    fullnames = {}
    for release, why in LONG_RELEASES.items():
        objs = render_objects(EVERYTHING, release={"name": release, "namespace": "tessera"})
        names = [(o["kind"], o["metadata"]["name"]) for o in objs]
        bad = [n for n in names if not DNS_LABEL.match(n[1])]
        results.check(not bad, f"release {release!r} ({why}): every object's name is a DNS label "
                      "of at most 63 characters", str(bad))
        statefulset = by_kind(objs, "StatefulSet")[0]
        # The pods' controller-revision-hash label is <StatefulSet name>-<hash of 10>.
        results.check(len(statefulset["metadata"]["name"]) <= 52,
                      f"release {release!r}: the StatefulSet's name leaves room for its pods' "
                      "controller-revision-hash label", statefulset["metadata"]["name"])
        claim = f"state-{statefulset['metadata']['name']}-0"
        results.check(len(claim) <= 63, f"release {release!r}: the state claim's name {claim} fits")
        values = [(o["kind"], k, v) for o in objs for labels in (
            o["metadata"].get("labels", {}),
            o.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}))
            for k, v in labels.items() if len(str(v)) > 63]
        results.check(not values, f"release {release!r}: every label value fits 63 characters",
                      str(values))
        groups = {o["metadata"]["name"] for o in by_kind(objs, "DaemonSet")}
        results.check(len(groups) == 2, f"release {release!r}: one DaemonSet per worker group",
                      str(groups))
        fullnames[release] = statefulset["metadata"]["name"]
    results.check(len(set(fullnames.values())) == len(fullnames),
                  "different release names never share object names (long ones keep a hash)",
                  str(fullnames))
    results.check(fullnames["tessera"] == "tessera-coordinator"
                  and fullnames["prod-tessera-eu"] == "prod-tessera-eu-coordinator",
                  "short release names keep the names they had", str(fullnames))
