#!/usr/bin/env python3
"""LoRA fine-tuning in tessera-trainer, checked against Hugging Face PEFT itself.

For tiny random LlamaForCausalLM, Qwen3ForCausalLM and GPT2LMHeadModel models written by
save_pretrained, tessera-trainer fine-tunes LoRA adapters from the imported weights (standalone,
--init_from + --lora_rank) and then:
  * the final checkpoint holds only the adapters and their AdamW moments (the base is frozen);
  * its adapter/ directory loads with peft.PeftModel.from_pretrained onto the transformers base
    model, whose logits equal Tessera's own (--lora_adapter --logits_out) to 1e-4 and differ
    from the base model's (the adapters learned something);
  * --export_hf merges the adapter: transformers' logits of the merged model equal PEFT's, and
    every tensor of a layer without an adapter is the base's, bit for bit;
  * a run stopped after 4 steps and resumed reports the same losses for steps 5-8 as a run that
    never stopped (adapter dropout included);
and LoRA with tensor parallelism or an unknown target module is refused, naming the field.

Exit code 77 (ctest's skip) when transformers or peft is not installed. No downloads.
"""

import argparse
import json
import os
import sys
import tempfile

try:
    import peft
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file
    from hf_tiny_models import TOKENS, logits_of, make_model, run, tiny_configs
except ImportError as error:  # pragma: no cover - depends on the venv
    print(f"SKIP: {error} (scripts/bootstrap.sh installs transformers and peft into the torch "
          "venv)")
    sys.exit(77)

TOLERANCE = 1e-4

# model: (target modules as the spec names them, the weights they adapt in transformers' names)
CASES = {
    "llama": ([], ["_proj.weight"]),
    "qwen3": (["q_proj", "v_proj"], ["q_proj.weight", "v_proj.weight"]),
    "gpt2": (["c_attn", "mlp.c_proj"], ["attn.c_attn.weight", "mlp.c_proj.weight"]),
}


def losses_of(stdout):
    losses = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            report = json.loads(line)
            if "metrics" in report:
                losses[int(report["metrics"]["step"])] = float(report["metrics"]["loss"])
    return losses


def train_flags(model_dir, shards, targets, job):
    flags = [f"--init_from={model_dir}", f"--data={shards}", "--seq_len=64", "--global_batch=4",
             "--micro_batch=2", "--lr=5e-3", "--warmup=1", "--lora_rank=4", "--lora_alpha=16",
             "--lora_dropout=0.1", f"--job_id={job}"]
    if targets:
        flags.append("--lora_targets=" + ",".join(targets))
    return flags


def check_model(trainer, tmp, name, model, model_dir, shards, failures):
    targets, adapted = CASES[name]
    ckpt = os.path.join(tmp, f"{name}_ckpt")
    result = run(trainer, *train_flags(model_dir, shards, targets, f"lora-{name}"), "--steps=8",
                 f"--checkpoint_dir={ckpt}")
    losses = losses_of(result.stdout)
    assert sorted(losses) == list(range(1, 9)), result.stdout
    print(f"{name}: LoRA {targets or 'all-linear'}: loss {losses[1]:.4f} -> {losses[8]:.4f}")

    # Only adapters (and their moments) are checkpointed: the base is frozen.
    final = os.path.join(ckpt, "step-00000008")
    with safe_open(os.path.join(final, "rank-00000.safetensors"), "pt") as f:
        names = list(f.keys())
    tensors = [n for n in names if n.startswith(("model/", "exp_avg/", "exp_avg_sq/"))]
    frozen = [n for n in tensors if not (n.endswith(".lora_a") or n.endswith(".lora_b"))]
    assert tensors and not frozen, f"checkpoint holds non-adapter tensors: {frozen[:5]}"

    # PEFT loads the adapter onto transformers' base model and gives Tessera's logits.
    adapter = os.path.join(final, "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["r"] == 4 and config["lora_alpha"] == 16, config
    peft_model = peft.PeftModel.from_pretrained(model, adapter).eval()
    peft_logits = logits_of(peft_model)
    ours = os.path.join(tmp, f"{name}_lora.logits")
    run(trainer, f"--init_from={model_dir}", f"--lora_adapter={adapter}",
        "--logits_tokens=" + ",".join(map(str, TOKENS)), f"--logits_out={ours}")
    tessera_logits = load_file(ours)["logits"]
    diff = (tessera_logits - peft_logits).abs().max().item()
    with peft_model.disable_adapter():
        moved = (logits_of(peft_model) - peft_logits).abs().max().item()
    print(f"{name}: Tessera vs PEFT max |logit diff| = {diff:.3g} (the adapter moves the logits "
          f"by up to {moved:.3g})")
    if not diff <= TOLERANCE:
        failures.append(f"{name}: PEFT logits differ from Tessera's by {diff}")
    if not moved > 10 * TOLERANCE:
        failures.append(f"{name}: the trained adapter does not change the logits ({moved})")

    # Merged export: transformers' logits equal PEFT's; layers without adapters are the base's.
    merged_dir = os.path.join(tmp, f"{name}_merged")
    run(trainer, f"--init_from={model_dir}", f"--lora_adapter={adapter}",
        f"--export_hf={merged_dir}")
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    diff = (logits_of(merged) - peft_logits).abs().max().item()
    print(f"{name}: merged export vs PEFT max |logit diff| = {diff:.3g}")
    if not diff <= TOLERANCE:
        failures.append(f"{name}: merged export's logits differ from PEFT's by {diff}")
    base_state = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    merged_state = merged.state_dict()
    kept = [key for key in base_state if not any(key.endswith(t) for t in adapted)]
    changed = [key for key in kept if not torch.equal(base_state[key], merged_state[key])]
    print(f"{name}: {len(kept) - len(changed)} of {len(kept)} tensors without an adapter are the "
          "base's, bit for bit")
    if changed or len(kept) == len(base_state):
        failures.append(f"{name}: tensors without an adapter changed: {changed[:5]}")


def check_resume(trainer, tmp, name, model_dir, shards, failures):
    """Steps 5-8 after a stop at step 4 equal those of a run that never stopped."""
    targets, _ = CASES[name]
    # A constant learning rate after warmup, so that a 4-step run is the first half of 8 steps.
    flags = train_flags(model_dir, shards, targets, f"lora-{name}-resume") + ["--min_lr_ratio=1"]
    straight = losses_of(run(trainer, *flags, "--steps=8").stdout)
    ckpt = os.path.join(tmp, f"{name}_resume_ckpt")
    run(trainer, *flags, "--steps=4", f"--checkpoint_dir={ckpt}")
    second = run(trainer, *flags, "--steps=8", f"--checkpoint_dir={ckpt}")
    assert "resumed from" in second.stderr, second.stderr
    resumed = losses_of(second.stdout)
    assert sorted(resumed) == [5, 6, 7, 8], second.stdout
    same = [resumed[step] == straight[step] for step in range(5, 9)]
    print(f"{name}: resumed at step 4; losses of steps 5-8 equal the uninterrupted run's: {same}")
    if not all(same):
        failures.append(f"{name}: resumed losses {resumed} differ from {straight}")


def check_refusals(trainer, model_dir, shards):
    base = [f"--init_from={model_dir}", f"--data={shards}", "--seq_len=64", "--global_batch=4",
            "--micro_batch=2", "--steps=1", "--lora_rank=4"]
    result = run(trainer, *base, "--lora_targets=c_attn", expect_ok=False)
    assert result.returncode != 0 and "lora.target_modules: 'c_attn'" in result.stderr, (
        result.stderr)
    print("  refused as expected:", result.stderr.strip().splitlines()[-1][:160])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--corpus", required=True)
    args = parser.parse_args()
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, "
          f"torch {torch.__version__}")
    failures = []
    with tempfile.TemporaryDirectory(prefix="lora_peft_") as tmp:
        data = os.path.join(tmp, "data")
        run(args.trainer, "prepare", f"--input={args.corpus}", f"--output_dir={data}")
        shards = os.path.join(data, "train-*.bin")
        for seed, (name, config) in enumerate(tiny_configs().items()):
            model = make_model(config, seed)
            model_dir = os.path.join(tmp, name)
            model.save_pretrained(model_dir)
            check_model(args.trainer, tmp, name, model, model_dir, shards, failures)
            check_resume(args.trainer, tmp, name, model_dir, shards, failures)
        check_refusals(args.trainer, os.path.join(tmp, "llama"), shards)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
