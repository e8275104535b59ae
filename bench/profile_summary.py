#!/usr/bin/env python3
"""Summarises Chrome traces of training steps: the trainer's (`tessera-trainer --profile_dir`)
and the PyTorch baseline's (bench/pytorch_baseline.py "profile_dir"), side by side.

    python3 bench/profile_summary.py TRACE.json [TRACE.json ...] [--json=OUT.json] [--top=60]

Per trace, over the steps marked "train_step":
  step           median wall time of a marked step on the host
  GPU busy       the union of kernel, copy and memset intervals over the profiled window (first
                 step's start to the later of the last step's end and the last GPU activity),
                 as a share of the window: well under 100% means the GPU waits on the host
  kernels        number and summed time per step, and by kind (matrix products, attention,
                 elementwise, reductions, softmax and cross-entropy, normalisation, optimizer,
                 copies, torch.compile's fused Triton kernels, other; from the kernel names)
  host           CUDA runtime calls per step: kernel launches, and calls that wait for the
                 device (synchronisations, blocking copies) with their time
  top kernels    by time per step; on a CPU trace, the top-level operators instead
Standard library only.
"""

import argparse
import collections
import json
import os
import re
import statistics
import sys

STEP = "train_step"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Kernel kinds by name, first match wins.
KINDS = (
    # torch.compile's generated pointwise, reduction and persistent-reduction kernels: many ops
    # fused in each (the name lists them), so they get a kind of their own.
    ("fused by torch.compile", re.compile(r"^triton_(poi|red|per)_")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|xmma|cutlass|nvjet|cublas|sm\d+_.*_tn|matmul|^triton_tem_",
                          re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("softmax / cross-entropy", re.compile(r"softmax|nll|cross_?entropy", re.I)),
    # The trainer's own norm kernels are NormForward*/NormBackward*/NormWeightGrad*.
    ("normalisation", re.compile(r"layer_norm|layernorm|rms_?norm|RmsNorm|batch_norm|"
                                 r"Norm(Forward|Backward|WeightGrad)", re.I)),
    ("reduction", re.compile(r"reduce|norm_kernel|sum_kernel", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|SwiGlu|Rotary|ResidualAdd|"
                               r"fill|copy|index|scatter|gather|cat", re.I)),
)
# Kernels (or operators) printed per trace; the summaries keep more (KEPT_TOP, for the JSON).
PRINTED_TOP = 15
KEPT_TOP = 60
SYNC_CALLS = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpy(HtoD|DtoH)(_v2)?$|"
                        r"cudaStreamWaitEvent|cudaEventSynchronize")
LAUNCH_CALLS = re.compile(r"LaunchKernel|cuLaunch|cudaLaunchCooperativeKernel")


def kind_of(name):
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def union_length(intervals):
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def top_level_ops(events):
    """cpu_op events not nested in another cpu_op of the same thread."""
    top = []
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e.get("tid")].append(e)
    for thread_events in by_thread.values():
        end = -1.0
        for e in sorted(thread_events, key=lambda e: (e["ts"], -e.get("dur", 0))):
            if e["ts"] >= end:
                top.append(e)
                end = e["ts"] + e.get("dur", 0)
    return top


def summarize(path, top_n):
    with open(path) as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents)")
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e.get("name") == STEP and
                    e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{path}: no '{STEP}' events (was it written by --profile_dir or the "
                         f"baseline's profile_dir?)")
    n = len(steps)
    window_start = steps[0]["ts"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and e["ts"] >= window_start]
    window_end = max([steps[-1]["ts"] + steps[-1]["dur"]] + [e["ts"] + e["dur"] for e in gpu])
    window = window_end - window_start
    summary = {
        "trace": path,
        "steps": n,
        "step_ms_median": statistics.median(e["dur"] for e in steps) / 1e3,
        "window_ms": window / 1e3,
    }
    if gpu:
        kernels = [e for e in gpu if e["cat"] == "kernel"]
        busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
        by_kind = collections.defaultdict(float)
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for e in kernels:
            by_kind[kind_of(e["name"])] += e["dur"]
            entry = by_name[e["name"]]
            entry[0] += 1
            entry[1] += e["dur"]
        for e in gpu:
            if e["cat"] != "kernel":
                by_kind["copies"] += e["dur"]
        runtime = [e for e in events if e.get("cat") == "cuda_runtime" and e["ts"] >= window_start]
        syncs = collections.defaultdict(lambda: [0, 0.0])
        for e in runtime:
            if SYNC_CALLS.search(e["name"]):
                syncs[e["name"]][0] += 1
                syncs[e["name"]][1] += e["dur"]
        summary.update({
            "gpu_busy_share": busy / window,
            "gpu_busy_ms_per_step": busy / n / 1e3,
            "kernels_per_step": len(kernels) / n,
            "kernel_ms_per_step": sum(e["dur"] for e in kernels) / n / 1e3,
            "kernel_ms_per_step_by_kind": {k: v / n / 1e3 for k, v in
                                           sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "launches_per_step": sum(1 for e in runtime if LAUNCH_CALLS.search(e["name"])) / n,
            "launch_ms_per_step": sum(e["dur"] for e in runtime
                                      if LAUNCH_CALLS.search(e["name"])) / n / 1e3,
            "waits_per_step": {name: {"calls": c / n, "ms": t / n / 1e3}
                               for name, (c, t) in sorted(syncs.items())},
            "top_kernels": [{"name": name, "per_step": c / n, "ms_per_step": t / n / 1e3}
                            for name, (c, t) in sorted(by_name.items(),
                                                       key=lambda kv: -kv[1][1])[:top_n]],
        })
    else:
        ops = [e for e in events if e.get("cat") == "cpu_op" and window_start <= e["ts"] <= window_end]
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for e in top_level_ops(ops):
            by_name[e["name"]][0] += 1
            by_name[e["name"]][1] += e["dur"]
        summary["top_operators"] = [{"name": name, "per_step": c / n, "ms_per_step": t / n / 1e3}
                                    for name, (c, t) in sorted(by_name.items(),
                                                               key=lambda kv: -kv[1][1])[:top_n]]
    return summary


def short(name, width=70):
    return name if len(name) <= width else name[:width - 3] + "..."


def print_summary(s):
    print(f"== {s['trace']}")
    print(f"  {s['steps']} steps, median step {s['step_ms_median']:.2f} ms on the host, window "
          f"{s['window_ms']:.1f} ms")
    if "gpu_busy_share" in s:
        print(f"  GPU busy {s['gpu_busy_share']:.1%} of the window ({s['gpu_busy_ms_per_step']:.2f} "
              f"ms per step); {s['kernels_per_step']:.0f} kernels per step, "
              f"{s['kernel_ms_per_step']:.2f} ms")
        print(f"  host: {s['launches_per_step']:.0f} launches per step "
              f"({s['launch_ms_per_step']:.2f} ms); waits per step: " +
              (", ".join(f"{k} x{v['calls']:.1f} ({v['ms']:.2f} ms)"
                         for k, v in s["waits_per_step"].items()) or "none"))
        print("  kernel time per step by kind: " +
              ", ".join(f"{k} {v:.2f} ms" for k, v in s["kernel_ms_per_step_by_kind"].items()))
        print("  top kernels (ms per step, calls per step):")
        for k in s["top_kernels"][:PRINTED_TOP]:
            print(f"    {k['ms_per_step']:8.3f}  x{k['per_step']:<6.1f} {short(k['name'])}")
    else:
        print("  top-level operators (ms per step, calls per step):")
        for k in s["top_operators"][:PRINTED_TOP]:
            print(f"    {k['ms_per_step']:8.3f}  x{k['per_step']:<6.1f} {short(k['name'])}")


def kernel_rows(a, b):
    """[(kind, a's ms per step, b's)] over both GPU summaries' kinds, then ("total", ...); empty
    unless both are GPU traces."""
    if not ("kernel_ms_per_step_by_kind" in a and "kernel_ms_per_step_by_kind" in b):
        return []
    kinds = dict.fromkeys(list(a["kernel_ms_per_step_by_kind"]) +
                          list(b["kernel_ms_per_step_by_kind"]))
    rows = [(k, a["kernel_ms_per_step_by_kind"].get(k, 0.0),
             b["kernel_ms_per_step_by_kind"].get(k, 0.0)) for k in kinds]
    return rows + [("total", a["kernel_ms_per_step"], b["kernel_ms_per_step"])]


def print_comparison(a, b):
    """Kernel time per step by kind, side by side (GPU traces only)."""
    rows = kernel_rows(a, b)
    if not rows:
        return
    print(f"== kernel ms per step: {os.path.basename(a['trace'])} vs "
          f"{os.path.basename(b['trace'])}")
    for k, x, y in rows:
        print(f"  {k:24s} {x:8.2f} {y:8.2f}  ({x - y:+.2f})")
    print(f"  {'GPU busy share':24s} {a['gpu_busy_share']:8.1%} {b['gpu_busy_share']:8.1%}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--json", default="", help="also write the summaries here")
    parser.add_argument("--top", type=int, default=KEPT_TOP,
                        help=f"kernels kept in --json (the first {PRINTED_TOP} are printed)")
    args = parser.parse_args()
    try:
        summaries = [summarize(path, args.top) for path in args.traces]
    except (OSError, ValueError) as e:
        print(f"profile_summary: {e}", file=sys.stderr)
        return 1
    for s in summaries:
        print_summary(s)
    if len(summaries) == 2:
        print_comparison(*summaries)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
