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
    from hf_tiny_models import (assert_adapter_only_checkpoint, check_merged_export,
                                check_peft_logits, make_model, merged, run, setting,
                                spec_args, tiny_configs)
except ImportError as error:  # pragma: no cover - depends on the venv
    print(f"SKIP: {error} (scripts/bootstrap.sh installs transformers and peft into the torch "
          "venv)")
    sys.exit(77)

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


def train_spec(model_dir, shards, targets, job, steps):
    spec = {"name": job, "model": {"from_pretrained": model_dir},
            "data": {"train_shards": [shards], "seq_len": 64}, "max_steps": steps,
            "batch": {"global_batch_size": 4, "micro_batch_size": 2},
            "optimizer": {"schedule": {"peak_learning_rate": 5e-3, "warmup_steps": 1,
                                       "min_lr_ratio": 0.1},
                          "weight_decay": 0.1, "grad_clip_norm": 1.0},
            "lora": {"rank": 4, "alpha": 16, "dropout": 0.1}}
    if targets:
        spec["lora"]["target_modules"] = targets
    return spec


def check_model(trainer, tmp, name, model, model_dir, shards, failures):
    targets, adapted = CASES[name]
    ckpt = os.path.join(tmp, f"{name}_ckpt")
    spec = train_spec(model_dir, shards, targets, f"lora-{name}".replace("_", "-"), 8)
    result = run(trainer, *spec_args(merged(spec, {"checkpoint": {"directory": ckpt}})))
    losses = losses_of(result.stdout)
    assert sorted(losses) == list(range(1, 9)), result.stdout
    print(f"{name}: LoRA {targets or 'all-linear'}: loss {losses[1]:.4f} -> {losses[8]:.4f}")

    # Only adapters (and their moments) are checkpointed: the base is frozen.
    final = os.path.join(ckpt, "step-00000008")
    assert_adapter_only_checkpoint(final)

    # PEFT loads the adapter onto transformers' base model and gives Tessera's logits.
    adapter = os.path.join(final, "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["r"] == 4 and config["lora_alpha"] == 16, config
    peft_logits = check_peft_logits(trainer, tmp, name, model, model_dir, adapter, failures)

    # Merged export: transformers' logits equal PEFT's; layers without adapters are the base's.
    merged_dir = os.path.join(tmp, f"{name}_merged")
    run(trainer, setting("model.from_pretrained", model_dir), f"--lora_adapter={adapter}",
        f"--export_hf={merged_dir}")
    base_state, merged_state, kept = check_merged_export(name, merged_dir, model_dir,
                                                         peft_logits, adapted, failures)
    changed = [key for key in kept if not torch.equal(base_state[key], merged_state[key])]
    print(f"{name}: {len(kept) - len(changed)} of {len(kept)} tensors without an adapter are the "
          "base's, bit for bit")
    if changed or len(kept) == len(base_state):
        failures.append(f"{name}: tensors without an adapter changed: {changed[:5]}")


def check_resume(trainer, tmp, name, model_dir, shards, failures):
    """Steps 5-8 after a stop at step 4 equal those of a run that never stopped."""
    targets, _ = CASES[name]
    # A constant learning rate after warmup, so that a 4-step run is the first half of 8 steps.
    job = f"lora-{name}-resume".replace("_", "-")
    spec = merged(train_spec(model_dir, shards, targets, job, 8),
                  {"optimizer": {"schedule": {"min_lr_ratio": 1}}})
    straight = losses_of(run(trainer, *spec_args(spec)).stdout)
    ckpt = os.path.join(tmp, f"{name}_resume_ckpt")
    saved = {"checkpoint": {"directory": ckpt}}
    run(trainer, *spec_args(merged(spec, {"max_steps": 4}, saved)))
    second = run(trainer, *spec_args(merged(spec, saved)))
    assert "resumed from" in second.stderr, second.stderr
    resumed = losses_of(second.stdout)
    assert sorted(resumed) == [5, 6, 7, 8], second.stdout
    same = [resumed[step] == straight[step] for step in range(5, 9)]
    print(f"{name}: resumed at step 4; losses of steps 5-8 equal the uninterrupted run's: {same}")
    if not all(same):
        failures.append(f"{name}: resumed losses {resumed} differ from {straight}")


def check_refusals(trainer, model_dir, shards):
    spec = train_spec(model_dir, shards, ["c_attn"], "lora-refused", 1)
    result = run(trainer, *spec_args(spec), expect_ok=False)
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
