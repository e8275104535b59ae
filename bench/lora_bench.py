#!/usr/bin/env python3
"""LoRA fine-tuning throughput: tessera-trainer's LoRA against its own full fine-tuning of the same
model, and against Hugging Face PEFT on transformers (eager PyTorch, as people run it) doing the
same LoRA and the same full fine-tuning, on the same machine in the same run.

    python bench/lora_bench.py          # make bench BENCH=lora (CPU)

The model is a small Llama written by transformers' save_pretrained (random weights): Tessera
imports it (model.from_pretrained), transformers loads it. LoRA: rank 16, alpha 32, no dropout,
on every linear layer of every block (PEFT's "all-linear", which leaves the LM head alone as Tessera
does). Both sides: float32 on CPU, AdamW (weight decay 0.1, clip 1.0), the same batch and
sequence length, all cores for intra-op threads. Each run is a fresh process; runs alternate
between the four sides. A run's throughput is the tokens of its timed steps over the sum of their
step times (the first untimed steps, start-up and loading excluded on every side alike); peak
memory is the process's maximum resident set. Figures are medians of --runs runs.

Results: a summary on stdout and $TESSERA_BENCH_RESULTS/lora.json. Skips (exit 0 with a note)
when transformers or peft is missing.
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
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 320,
    "max_position_embeddings": 512, "seq_len": 256, "batch": 8, "lora_rank": 16,
    "lora_alpha": 32, "lr": 1e-3, "untimed_steps": 3, "timed_steps": 12,
}
SIDES = ("tessera-lora", "peft-lora", "tessera-full", "transformers-full")


def make_model(directory):
    import torch
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=CONFIG["vocab_size"], hidden_size=CONFIG["hidden_size"],
        intermediate_size=CONFIG["intermediate_size"],
        num_hidden_layers=CONFIG["num_hidden_layers"],
        num_attention_heads=CONFIG["num_attention_heads"],
        num_key_value_heads=CONFIG["num_key_value_heads"],
        max_position_embeddings=CONFIG["max_position_embeddings"], tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def run_python_side(model_dir, lora):
    """One run of transformers (+ PEFT) in this process; prints its figures as JSON."""
    import torch
    import transformers
    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=CONFIG["lora_rank"], lora_alpha=CONFIG["lora_alpha"], lora_dropout=0.0,
            target_modules="all-linear", task_type="CAUSAL_LM"))
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
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:].contiguous()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    print(json.dumps({"step_times": times, "trainable": sum(p.numel() for p in params),
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run_python(model_dir, lora, job):
    python = sys.executable
    result = subprocess.run([python, os.path.abspath(__file__), "--side",
                             "peft" if lora else "transformers", "--model_dir", model_dir],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise bench_common.BenchError(f"{job}: failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--side", choices=("peft", "transformers"))
    parser.add_argument("--model_dir")
    args = parser.parse_args()
    if args.side:
        run_python_side(args.model_dir, args.side == "peft")
        return 0
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        print(f"lora: skipped: {error} (scripts/bootstrap.sh installs transformers and peft)")
        return 0
    found = bench_common.find_trainer("lora")
    if found is None:
        return 1
    _, trainer = found
    started = time.time()
    figures = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        model_dir = os.path.join(tmp, "model")
        make_model(model_dir)
        shards = bench_common.prepare_corpus(trainer, tmp, 300)
        for run in range(args.runs):
            for side in SIDES:
                lora = side.endswith("lora")
                job = f"{side}-{run}"
                if side.startswith("tessera"):
                    result = bench_common.run_init_from(
                        trainer, CONFIG, model_dir, shards, job, timeout=600,
                        extra_spec={"lora": {"rank": CONFIG["lora_rank"],
                                             "alpha": CONFIG["lora_alpha"]}} if lora else None)
                else:
                    result = run_python(model_dir, lora, job)
                result["tokens_per_second"] = bench_common.timed_tokens_per_second(result, CONFIG)
                figures[side].append(result)
                print(f"  run {run}: {side:18s} {result['tokens_per_second']:8.0f} tokens/s, "
                      f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    bench_common.report_sides("lora", CONFIG, figures, lambda medians: {
        "tessera_lora_vs_peft_lora": medians["tessera-lora"] / medians["peft-lora"],
        "tessera_full_vs_transformers_full":
            medians["tessera-full"] / medians["transformers-full"],
        "tessera_lora_vs_tessera_full": medians["tessera-lora"] / medians["tessera-full"],
        "peft_lora_vs_transformers_full": medians["peft-lora"] / medians["transformers-full"],
    }, trainer, started)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except bench_common.BenchError as error:
        print(f"lora: {error}", file=sys.stderr)
        sys.exit(1)
