"""What the chart's tests share: rendering with Helm itself, and reading the rendered objects.

Imported by chart_test.py, chart_lifecycle.py and chart_options.py (the tools venv has the
packages; chart_test.py reports the test skipped when it does not).
"""
import pathlib
import re
import shutil

import yaml
from helm_python.chart import Chart

DEPLOY = pathlib.Path(__file__).resolve().parent.parent
CHART = DEPLOY / "helm" / "tessera"
DEFAULT_RELEASE = {"name": "tessera", "namespace": "tessera"}


def render(values, release=DEFAULT_RELEASE, chart=CHART):
    """{template path: text} of the chart's YAML templates, after the values schema's check."""
    with Chart.load(str(chart)) as loaded:
        loaded.validate_schema(values)
        rendered = loaded.render(values=values, **release)
    return {path: text for path, text in sorted(rendered.items()) if path.endswith(".yaml")}


def objects(rendered):
    for text in rendered.values():
        for obj in yaml.safe_load_all(text):
            if obj:
                yield obj


def render_objects(values, release=DEFAULT_RELEASE, chart=CHART):
    return list(objects(render(values, release, chart)))


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def flag(container, name):
    """The value of --name=VALUE in the container's args (dashes), or None."""
    values = [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"--{name}=")]
    return values[0] if values else None


def versioned_copy(directory, version, app_version):
    """A copy of the chart under `directory` whose Chart.yaml says `version` and `appVersion`
    (what a chart release changes); returns its path."""
    copy = pathlib.Path(directory) / "tessera"
    shutil.copytree(CHART, copy)
    chart_yaml = copy / "Chart.yaml"
    text = chart_yaml.read_text()
    text, versions = re.subn(r"^version: .*$", f"version: {version}", text, flags=re.M)
    text, app_versions = re.subn(r"^appVersion: .*$", f'appVersion: "{app_version}"', text,
                                 flags=re.M)
    assert versions == 1 and app_versions == 1, "Chart.yaml: version or appVersion not found"
    chart_yaml.write_text(text)
    return copy


class Results:
    def __init__(self):
        self.passed, self.failed = [], []

    def check(self, ok, name, detail=""):
        (self.passed if ok else self.failed).append(name + (f": {detail}" if detail and not ok else ""))
