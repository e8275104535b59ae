#!/usr/bin/env python3
"""The planner's estimates next to what the trainer measures, for expert and context parallelism
on CPU: step time, the all-to-all and ring-attention seconds, and peak memory per rank.

    python bench/planner_fit_bench.py          # make bench BENCH=planner-fit (CPU)

How it runs:
  1. `tessera-trainer prepare` tokenizes data/corpus/kjv-genesis-ruth.txt into byte-level shards.
  2. Layouts (LAYOUTS): a small Llama-style mixture of experts (4 layers x 256, 8 experts of width
     256, top-2) at ep1 (one process), dp2 (two processes, the experts replicated) and dp2 x ep2
     (the experts split over the pair, tokens exchanged by all-to-all); a dense model of the same
     blocks at 1,024 tokens per sequence at cp1 and cp2 (ring attention). Each rank is its own
     process over Gloo with one intra-op thread: the planner's "cpu" device is one trainer slot of
     about one core. Runs are interleaved (every layout, then again) so that drifting load falls
     on all alike; every figure is the median over --runs runs.
  3. Measured, per run: the step time (median of rank 0's step_time_seconds over the timed
     steps); the seconds per step of the all-to-alls and of the ring's send/recv (each
     rank's rank_step breakdown, median over the timed steps, mean over the ranks: host wall time
     from issuing a collective to the end of its wait, so a rank that waits for a slower peer
     counts the wait, and the ring counts the attention its hops overlap); peak memory per rank
     (the largest peak RSS any rank reports).
  3b. Probed, per run of a layout with ep or cp > 1: the same layout again with
     `tessera-trainer --collective_probe` (a barrier on the group before each collective, the
     collective waited for at once), which splits each collective's time into the wait for the
     slowest peer (peer_wait_seconds) and the transfer (seconds). The transfer is what the
     planner prices; its ratio to the plan is the calibrated one, and its bytes (each rank's
     input, per step) over its seconds the bandwidth achieved. The probed run's step time is not
     used (the barriers and lost overlap slow it).
  4. The process's own memory: the same layout with a model of width 32 (BASELINE_DIMS) runs
     once per round, and its peak RSS (libtorch, Gloo, the allocator's arenas, the data loader)
     is subtracted from the measured peak before comparing with the planner, whose CPU device
     counts no runtime overhead.
  5. Planned: `tessera plan SPEC --device=cpu --layout=...` (planner/layout_model.cc) for the same
     spec and layout: est_step_time_s, step_time.expert_all_to_all_s, step_time.context_ring_s and
     memory.peak_bytes.
  6. Printed and written: measured / planned for each figure and layout. A ratio outside [0.5, 2]
     is flagged.
  7. Every layout must compute the same thing: the first step's loss within 1e-5 relative of the
     first run of the model's first layout (same weights, same data), else the benchmark fails.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/planner-fit.json.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (RESULTS_ENV, RUN_TIMEOUT_SECONDS, BenchError, find_trainer,  # noqa: E402
                          in_workdir, json_lines, prepare_corpus, provenance, run_ranks, spread,
                          step_reports, write_cpu_spec, write_results)

POLL_SECONDS = 0.05
LOSS_TOLERANCE_FIRST = 1e-5
FLAG_BELOW, FLAG_ABOVE = 0.5, 2.0

BLOCKS = {"architecture": "ARCHITECTURE_LLAMA", "num_layers": 4, "hidden_size": 256,
          "num_attention_heads": 8, "num_kv_heads": 4, "head_dim": 32, "ffn_hidden_size": 688,
          "vocab_size": 320, "tie_embeddings": False}
EXPERTS = {"num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 256,
           "norm_topk_prob": True, "router_aux_loss_coef": 0.01}
# The same layouts with a model of width 32: what the process holds besides the model.
BASELINE_DIMS = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_kv_heads": 2,
                 "head_dim": 16, "ffn_hidden_size": 64, "moe_intermediate_size": 32}
OPTIMIZER = {"schedule": {"peak_learning_rate": 1e-3, "warmup_steps": 1, "min_lr_ratio": 0.1,
                          "decay_steps": 0},
             "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8,
             "grad_clip_norm": 1.0}
MODELS = {
    "moe": {"name": "moe-4x256-e8k2", "dims": {**BLOCKS, **EXPERTS, "max_seq_len": 256},
            "seq_len": 256, "global_batch_size": 8, "micro_batch_size": 2},
    "dense-long": {"name": "llama-4x256-seq1024", "dims": {**BLOCKS, "max_seq_len": 1024},
                   "seq_len": 1024, "global_batch_size": 2, "micro_batch_size": 1},
}
STEPS = {"untimed_steps": 2, "timed_steps": 4}
LAYOUTS = (
    {"name": "ep1", "model": "moe", "dp": 1, "ep": 1, "cp": 1},
    {"name": "dp2", "model": "moe", "dp": 2, "ep": 1, "cp": 1},
    {"name": "dp2-ep2", "model": "moe", "dp": 2, "ep": 2, "cp": 1},
    {"name": "cp1", "model": "dense-long", "dp": 1, "ep": 1, "cp": 1},
    {"name": "cp2", "model": "dense-long", "dp": 1, "ep": 1, "cp": 2},
)


def world(layout):
    return layout["dp"] * layout["cp"]


def model_config(layout, baseline=False):
    model = MODELS[layout["model"]]
    dims = dict(model["dims"])
    if baseline:
        dims.update({k: v for k, v in BASELINE_DIMS.items() if k in dims})
    return {"name": model["name"] + ("-baseline" if baseline else ""), "model": {"dims": dims},
            "seq_len": model["seq_len"], "global_batch_size": model["global_batch_size"],
            "micro_batch_size": model["micro_batch_size"], "optimizer": OPTIMIZER, "seed": 7,
            **STEPS}


def layout_proto(layout):
    return {"data_parallel": layout["dp"], "tensor_parallel": 1, "pipeline_parallel": 1,
            "expert_parallel": layout["ep"], "context_parallel": layout["cp"], "zero_stage": 0,
            "activation_checkpointing_mode": "ACTIVATION_CHECKPOINTING_NONE"}


def plan(cli, workdir, layout):
    """The planner's estimate of `layout` (layouts[0] of `tessera plan --output=json`)."""
    config = model_config(layout)
    spec = {"name": f"planner-fit-{layout['name']}", "model": config["model"],
            "data": {"train_shards": ["unused-*.bin"], "seq_len": config["seq_len"]},
            "batch": {"global_batch_size": config["global_batch_size"],
                      "micro_batch_size": config["micro_batch_size"]},
            "optimizer": OPTIMIZER, "precision": "PRECISION_FP32",
            "resources": {"cpu_slots": world(layout)}}
    path = os.path.join(workdir, f"{layout['name']}.spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    text = f"dp={layout['dp']},ep={layout['ep']},cp={layout['cp']},tp=1,pp=1,zero=0,ac=none"
    out = subprocess.run([cli, "--output=json", "plan", path, "--device=cpu",
                          "--device_override=memory_bytes=64GiB", f"--gpus={world(layout)}",
                          f"--gpus_per_node={world(layout)}", f"--layout={text}"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise BenchError(f"tessera plan {layout['name']}: {out.stderr.strip()}")
    candidate = json.loads(out.stdout)["layouts"][0]
    return {"step_seconds": candidate["est_step_time_s"],
            "all_to_all_seconds": candidate["step_time"]["expert_all_to_all_s"],
            "ring_seconds": candidate["step_time"]["context_ring_s"],
            "peak_bytes": candidate["memory"]["peak_bytes"],
            "memory": candidate["memory"], "step_time": candidate["step_time"]}


def collective_seconds(breakdown, kind, field="seconds"):
    """`field` of the collectives of `kind` over any group: only expert parallelism runs
    all-to-alls and only ring attention sends and receives in these layouts (no pipeline), and
    a group that spans the whole world is reported as "world", not as "ep" or "cp"."""
    return sum(float(c.get(field, 0)) for c in breakdown.get("collectives", [])
               if c.get("kind") == kind)


def probed(layout):
    return layout["ep"] > 1 or layout["cp"] > 1


def run_layout(trainer, task, layout, workdir, label, args=()):
    """One run's figures: rank 0's step time, the ranks' collective seconds (and, probed, their
    peer wait), peak RSS."""
    procs, load = run_ranks(trainer, task, world(layout), 1, workdir, label, RUN_TIMEOUT_SECONDS,
                            POLL_SECONDS, args=args)
    steps = STEPS["untimed_steps"] + STEPS["timed_steps"]
    _, metrics = step_reports(procs[0], steps, label)
    times = [float(m["step_time_seconds"]) for m in metrics][STEPS["untimed_steps"]:]
    all_to_all, ring, all_to_all_wait, ring_wait, peaks = [], [], [], [], []
    all_to_all_bytes, ring_bytes = [], []
    for p in procs:
        reports = json_lines(p["out"], label) + json_lines(p["err"], label)
        rank_steps = [r["rank_step"] for r in reports if "rank_step" in r and
                      int(r["rank_step"].get("step", 0)) > STEPS["untimed_steps"]]
        if len(rank_steps) != STEPS["timed_steps"]:
            raise BenchError(f"{label} rank {p['rank']}: {len(rank_steps)} rank_step reports of "
                             f"timed steps, expected {STEPS['timed_steps']}")
        breakdowns = [r.get("breakdown", {}) for r in rank_steps]
        all_to_all.append(statistics.median(collective_seconds(b, "all_to_all")
                                            for b in breakdowns))
        ring.append(statistics.median(collective_seconds(b, "send_recv")
                                      for b in breakdowns))
        all_to_all_wait.append(statistics.median(
            collective_seconds(b, "all_to_all", "peer_wait_seconds") for b in breakdowns))
        ring_wait.append(statistics.median(
            collective_seconds(b, "send_recv", "peer_wait_seconds") for b in breakdowns))
        all_to_all_bytes.append(statistics.median(
            collective_seconds(b, "all_to_all", "bytes") for b in breakdowns))
        ring_bytes.append(statistics.median(
            collective_seconds(b, "send_recv", "bytes") for b in breakdowns))
        peaks.append(max(p["rusage"].ru_maxrss * 1024,
                         max(int(r.get("peak_memory_bytes", 0)) for r in rank_steps)))
    return {"step_seconds": statistics.median(times),
            "all_to_all_seconds": sum(all_to_all) / len(all_to_all),
            "ring_seconds": sum(ring) / len(ring),
            "all_to_all_peer_wait_seconds": sum(all_to_all_wait) / len(all_to_all_wait),
            "ring_peer_wait_seconds": sum(ring_wait) / len(ring_wait),
            "all_to_all_bytes": sum(all_to_all_bytes) / len(all_to_all_bytes),
            "ring_bytes": sum(ring_bytes) / len(ring_bytes),
            "peak_rss_bytes": max(peaks),
            "first_loss": float(metrics[0]["loss"]), "load_average_before": load}


def ratio(measured, planned):
    return measured / planned if planned > 0 else None


PROBED_KEYS = ("all_to_all_seconds", "ring_seconds", "all_to_all_peer_wait_seconds",
               "ring_peer_wait_seconds", "all_to_all_bytes", "ring_bytes")


def summarize(layout, runs, baselines, planned, probes):
    median = {k: statistics.median(r[k] for r in runs)
              for k in ("step_seconds", "all_to_all_seconds", "ring_seconds", "peak_rss_bytes")}
    probe = {k: statistics.median(r[k] for r in probes) for k in PROBED_KEYS} if probes else {}
    if probe:
        # What the transfers achieved: each rank's input bytes over their transfer seconds.
        for kind in ("all_to_all", "ring"):
            seconds = probe[f"{kind}_seconds"]
            probe[f"{kind}_gb_per_s"] = probe[f"{kind}_bytes"] / seconds / 1e9 if seconds else None
    baseline_rss = statistics.median(b["peak_rss_bytes"] for b in baselines)
    model_bytes = median["peak_rss_bytes"] - baseline_rss
    ratios = {"step_time": ratio(median["step_seconds"], planned["step_seconds"]),
              "all_to_all": ratio(median["all_to_all_seconds"], planned["all_to_all_seconds"]),
              "ring": ratio(median["ring_seconds"], planned["ring_seconds"]),
              "memory_above_baseline": ratio(model_bytes, planned["peak_bytes"]),
              "memory_raw": ratio(median["peak_rss_bytes"], planned["peak_bytes"])}
    if probe:
        ratios["all_to_all_transfer"] = ratio(probe["all_to_all_seconds"],
                                              planned["all_to_all_seconds"])
        ratios["ring_transfer"] = ratio(probe["ring_seconds"], planned["ring_seconds"])
    # The unprobed collective times hold peer waits and overlapped compute: with a probe, the
    # transfer ratios are the ones judged.
    unjudged = {"memory_raw"} | ({"all_to_all", "ring"} if probe else set())
    flagged = [k for k, v in ratios.items()
               if v is not None and k not in unjudged and not FLAG_BELOW <= v <= FLAG_ABOVE]
    return {"layout": layout, "planned": planned, "measured_median": median,
            "baseline_peak_rss_bytes": baseline_rss, "model_bytes_above_baseline": model_bytes,
            "ratios_measured_over_planned": ratios, "off_by_more_than_2x": flagged,
            "runs": {k: spread([r[k] for r in runs]) for k in
                     ("step_seconds", "all_to_all_seconds", "ring_seconds", "peak_rss_bytes")},
            "baseline_runs": [b["peak_rss_bytes"] for b in baselines],
            "probed_median": probe,
            "probed_runs": {k: spread([r[k] for r in probes]) for k in PROBED_KEYS}
            if probes else {}}


def fmt_ratio(value):
    return "   -  " if value is None else f"{value:6.2f}"


def print_summary(results):
    print("planner_fit_bench: measured / planned (medians)")
    print(f"  {'layout':<9} {'step s':>8} {'plan':>8} {'ratio':>6}  {'a2a s':>7} {'plan':>7} "
          f"{'ratio':>6}  {'ring s':>7} {'plan':>7} {'ratio':>6}  {'mem MiB':>8} {'plan':>7} "
          f"{'ratio':>6}")
    for entry in results["layouts"]:
        m, p, r = entry["measured_median"], entry["planned"], entry["ratios_measured_over_planned"]
        print(f"  {entry['layout']['name']:<9} {m['step_seconds']:8.3f} {p['step_seconds']:8.3f} "
              f"{fmt_ratio(r['step_time'])}  {m['all_to_all_seconds']:7.4f} "
              f"{p['all_to_all_seconds']:7.4f} {fmt_ratio(r['all_to_all'])}  "
              f"{m['ring_seconds']:7.4f} {p['ring_seconds']:7.4f} {fmt_ratio(r['ring'])}  "
              f"{entry['model_bytes_above_baseline'] / 2**20:8.1f} "
              f"{p['peak_bytes'] / 2**20:7.1f} {fmt_ratio(r['memory_above_baseline'])}"
              + (f"  off by > 2x: {', '.join(entry['off_by_more_than_2x'])}"
                 if entry["off_by_more_than_2x"] else ""))
    probed_entries = [e for e in results["layouts"] if e["probed_median"]]
    if probed_entries:
        print("  probed (--collective_probe): transfer / planned, and the wait for peers")
        for entry in probed_entries:
            q, p = entry["probed_median"], entry["planned"]
            r = entry["ratios_measured_over_planned"]
            print(f"  {entry['layout']['name']:<9} a2a transfer {q['all_to_all_seconds']:7.4f} "
                  f"plan {p['all_to_all_seconds']:7.4f} {fmt_ratio(r['all_to_all_transfer'])} "
                  f"wait {q['all_to_all_peer_wait_seconds']:7.4f}  ring transfer "
                  f"{q['ring_seconds']:7.4f} plan {p['ring_seconds']:7.4f} "
                  f"{fmt_ratio(r['ring_transfer'])} wait {q['ring_peer_wait_seconds']:7.4f}"
                  + "".join(f"  {kind} {q[kind + '_bytes'] / 2**20:.1f} MiB at "
                            f"{q[kind + '_gb_per_s']:.2f} GB/s"
                            for kind in ("all_to_all", "ring") if q[kind + "_gb_per_s"]))


def main():
    parser = argparse.ArgumentParser(description="planner estimates vs measured, ep and cp, CPU")
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds of all layouts")
    parser.add_argument("--keep-workdir", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated layout names to run")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    layouts = [l for l in LAYOUTS if not args.only or l["name"] in args.only.split(",")]
    found = find_trainer("planner_fit_bench")
    if not found:
        return 2
    build_dir, built = found
    cli = os.path.join(build_dir, "bin", "tessera")
    if not os.access(cli, os.X_OK):
        print(f"planner_fit_bench: {cli} not found; build the tessera target", file=sys.stderr)
        return 2
    results_dir = os.environ.get(RESULTS_ENV) or os.path.join(build_dir, "bench", "results")
    workdir = tempfile.mkdtemp(prefix="tessera-planner-fit-bench-")
    trainer = os.path.join(workdir, "tessera-trainer")
    shutil.copy2(built, trainer)
    started = time.perf_counter()
    # Before measure(): in_workdir removes the copy of the binary with the work directory.
    built_from = provenance(built, trainer)

    def measure():
        shards = prepare_corpus(trainer, workdir, RUN_TIMEOUT_SECONDS)
        tasks, planned = {}, {}
        for layout in layouts:
            for baseline in (False, True):
                name = layout["name"] + ("-baseline" if baseline else "")
                tasks[name] = os.path.join(workdir, f"{name}.job.json")
                write_cpu_spec(tasks[name], "planner-fit-bench", name,
                               model_config(layout, baseline), shards, layout_proto(layout),
                               world(layout))
            planned[layout["name"]] = plan(cli, workdir, layout)
        runs = {l["name"]: [] for l in layouts}
        baselines = {l["name"]: [] for l in layouts}
        probes = {l["name"]: [] for l in layouts}
        first_loss = {}
        for round_index in range(args.runs):
            for layout in layouts:
                label = f"{layout['name']}.round{round_index + 1}"
                run = run_layout(trainer, tasks[layout["name"]], layout, workdir, label)
                reference = first_loss.setdefault(layout["model"], run["first_loss"])
                if abs(run["first_loss"] - reference) > LOSS_TOLERANCE_FIRST * abs(reference):
                    raise BenchError(f"{label}: first loss {run['first_loss']} differs from the "
                                     f"model's first run's {reference}")
                runs[layout["name"]].append(run)
                base = run_layout(trainer, tasks[layout["name"] + "-baseline"], layout, workdir,
                                  label + "-baseline")
                baselines[layout["name"]].append(base)
                if probed(layout):
                    probe = run_layout(trainer, tasks[layout["name"]], layout, workdir,
                                       label + "-probed", args=("--collective_probe",))
                    probes[layout["name"]].append(probe)
                    print(f"  round {round_index + 1} {layout['name']:<8} probed: all-to-all "
                          f"{probe['all_to_all_seconds']:.4f} s + wait "
                          f"{probe['all_to_all_peer_wait_seconds']:.4f} s, ring "
                          f"{probe['ring_seconds']:.4f} s + wait "
                          f"{probe['ring_peer_wait_seconds']:.4f} s", flush=True)
                print(f"  round {round_index + 1} {layout['name']:<8} step "
                      f"{run['step_seconds']:.3f} s, all-to-all {run['all_to_all_seconds']:.4f} "
                      f"s, ring {run['ring_seconds']:.4f} s, peak RSS "
                      f"{run['peak_rss_bytes'] / 2**20:.0f} MiB (baseline "
                      f"{base['peak_rss_bytes'] / 2**20:.0f}), load before "
                      f"{run['load_average_before']:.1f}", flush=True)
        return [summarize(l, runs[l["name"]], baselines[l["name"]], planned[l["name"]],
                          probes[l["name"]]) for l in layouts]

    summaries = in_workdir("planner_fit_bench", workdir, args.keep_workdir, measure)
    if summaries is None:
        return 1
    results = {"benchmark": "planner-fit", "device": "cpu", **built_from,
               "models": MODELS, "steps": STEPS, "rounds": args.runs,
               "method": __doc__.split("How it runs:")[1].split("Results:")[0].strip(),
               "layouts": summaries, "wall_seconds": time.perf_counter() - started}
    print_summary(results)
    write_results(results, results_dir, "planner-fit.json", "planner_fit_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
