"""tessera-trainer command lines from a job spec held as a Python dict.

tessera-trainer takes a job spec (a file with --job_spec, and --set PATH=VALUE settings over it or
alone) and goes through the coordinator's validation and planning like a submitted job. Tests and
benchmarks build their specs as dicts, the shape of a spec file, and pass them with spec_args().
"""

import json


def setting(path, value):
    """One --set argument: setting("model.preset", "tiny-gpt2")."""
    return f"--set={path}={json.dumps(value)}"


def spec_args(spec, world=1, gpus=False):
    """--set arguments giving tessera-trainer `spec` (nested dicts, as in a spec file), completed
    for a run of `world` processes (completed()). Each top-level field is one --set, its value as
    JSON (which is YAML)."""
    return [setting(key, value) for key, value in completed(spec, world, gpus).items()]


def completed(spec, world=1, gpus=False):
    """A copy of `spec` completed for a run of `world` processes: resources (resources.gpus with
    `gpus`, else resources.cpu_slots) unless the spec has them, and, when it names an explicit
    layout (parallelism.layout), the model-parallel degrees it leaves out (1) and data_parallel,
    the rest of the world."""
    spec = json.loads(json.dumps(spec))  # a deep copy that the completion may change
    if "resources" not in spec:
        spec["resources"] = {"gpus" if gpus else "cpu_slots": world}
    layout = spec.get("parallelism", {}).get("layout") if isinstance(spec.get("parallelism"),
                                                                      dict) else None
    if layout is not None:
        layout.setdefault("tensor_parallel", 1)
        layout.setdefault("pipeline_parallel", 1)
        others = (layout["tensor_parallel"] * layout["pipeline_parallel"] *
                  max(1, layout.get("context_parallel", 1)))
        if "data_parallel" not in layout and world % others == 0:
            layout["data_parallel"] = world // others
    return spec


def merged(base, *changes):
    """`base` with each of `changes` laid over it, field by field (nested dicts merge; any other
    value replaces): merged(spec, {"optimizer": {"schedule": {"warmup_steps": 0}}})."""
    out = json.loads(json.dumps(base))
    for change in changes:
        _merge_into(out, change)
    return out


def _merge_into(out, change):
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            _merge_into(out[key], value)
        else:
            out[key] = json.loads(json.dumps(value))
