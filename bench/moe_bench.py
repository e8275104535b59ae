#!/usr/bin/env python3
"""Mixture-of-experts training throughput on the CPU: tessera-trainer against the same model in
eager PyTorch (transformers' Qwen3MoeForCausalLM, whose experts loop in Python as people run
it), with the same weights, on the same machine in the same run.

    python bench/moe_bench.py          # make bench BENCH=moe (CPU)

The model is a small Qwen3-MoE written by transformers' save_pretrained (random weights): 8
experts, top-2, in each of 4 layers. Tessera imports it (--init_from), transformers loads it.
Both sides: full fine-tuning in float32 on the CPU with the router's load-balancing loss in the
loss (transformers: output_router_logits), AdamW (weight decay 0.1, clip 1.0), the same batch and
sequence length, all cores for intra-op threads. Each run is a fresh process; runs alternate
between the sides. A run's throughput is the tokens of its timed steps over the sum of their step
times (the first untimed steps, start-up and loading excluded on both sides alike); peak memory is
the process's maximum resident set. Figures are medians of --runs runs; the ratio is Tessera's
median tokens/s over eager PyTorch's.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/moe.json. Skips (exit 0 with a note)
when transformers is missing.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402

CONFIG = {
    "hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 320,
    "max_position_embeddings": 512, "router_aux_loss_coef": 0.01, "seq_len": 256, "batch": 8,
    "lr": 1e-3, "untimed_steps": 3, "timed_steps": 12,
}
SIDES = ("tessera", "eager")


def make_model(directory):
    import torch
    import transformers
    config = transformers.Qwen3MoeConfig(
        vocab_size=CONFIG["vocab_size"], hidden_size=CONFIG["hidden_size"],
        intermediate_size=CONFIG["intermediate_size"],
        moe_intermediate_size=CONFIG["moe_intermediate_size"],
        num_hidden_layers=CONFIG["num_hidden_layers"],
        num_attention_heads=CONFIG["num_attention_heads"],
        num_key_value_heads=CONFIG["num_key_value_heads"], head_dim=CONFIG["head_dim"],
        num_experts=CONFIG["num_experts"], num_experts_per_tok=CONFIG["num_experts_per_tok"],
        norm_topk_prob=True, router_aux_loss_coef=CONFIG["router_aux_loss_coef"],
        max_position_embeddings=CONFIG["max_position_embeddings"], tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def run_eager_side(model_dir):
    """One run of transformers in this process; prints its figures as JSON."""
    import torch
    import transformers
    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=CONFIG["lr"],
                                  betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(1)
    times = []
    for _ in range(CONFIG["untimed_steps"] + CONFIG["timed_steps"]):
        tokens = torch.randint(0, 257, (CONFIG["batch"], CONFIG["seq_len"] + 1),
                               generator=generator)
        start = time.perf_counter()
        # transformers shifts the labels itself.
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1],
                     output_router_logits=True).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    print(json.dumps({"step_times": times,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run_eager(model_dir, job):
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--side", "eager",
                             "--model_dir", model_dir, f"--timed_steps={CONFIG['timed_steps']}",
                             f"--batch={CONFIG['batch']}", f"--seq_len={CONFIG['seq_len']}"],
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise bench_common.BenchError(f"{job}: failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    # Smaller figures for a loaded or slow machine; the eager side (a subprocess) gets them too.
    parser.add_argument("--timed_steps", type=int, default=CONFIG["timed_steps"])
    parser.add_argument("--batch", type=int, default=CONFIG["batch"])
    parser.add_argument("--seq_len", type=int, default=CONFIG["seq_len"])
    parser.add_argument("--side", choices=("eager",))
    parser.add_argument("--model_dir")
    args = parser.parse_args()
    CONFIG.update(timed_steps=args.timed_steps, batch=args.batch, seq_len=args.seq_len)
    if args.side:
        run_eager_side(args.model_dir)
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        print(f"moe: skipped: {error} (scripts/bootstrap.sh installs transformers)")
        return 0
    found = bench_common.find_trainer("moe")
    if found is None:
        return 1
    _, trainer = found
    started = time.time()
    figures = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="moe_bench_") as tmp:
        model_dir = os.path.join(tmp, "model")
        make_model(model_dir)
        shards = bench_common.prepare_corpus(trainer, tmp, 300)
        for run in range(args.runs):
            for side in SIDES:
                job = f"moe-{side}-{run}"
                if side == "tessera":
                    result = bench_common.run_init_from(trainer, CONFIG, model_dir, shards, job)
                else:
                    result = run_eager(model_dir, job)
                result["tokens_per_second"] = bench_common.timed_tokens_per_second(result, CONFIG)
                figures[side].append(result)
                print(f"  run {run}: {side:8s} {result['tokens_per_second']:8.0f} tokens/s, "
                      f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    bench_common.report_sides(
        "moe", CONFIG, figures,
        lambda medians: {"tessera_vs_eager": medians["tessera"] / medians["eager"]}, trainer,
        started)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except bench_common.BenchError as error:
        print(f"moe: {error}", file=sys.stderr)
        sys.exit(1)
