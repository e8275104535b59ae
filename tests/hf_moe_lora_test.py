#!/usr/bin/env python3
"""LoRA on mixture-of-experts experts in tessera-trainer, checked against Hugging Face PEFT.

For tiny random Qwen3MoeForCausalLM and MixtralForCausalLM models (4 experts, top-2) written by
save_pretrained, tessera-trainer fine-tunes adapters on the experts' projections (gate_proj /
up_proj / down_proj; Mixtral's w1 / w3 / w2) and on q_proj, with --export_format=hf
--export_merged, and then:
  * the PEFT adapter holds an A and a B for every expert of every layer and projection (each
    expert its own: a known failure of tools that adapt only a fused or a first expert), and
    every expert's B has trained away from its zero start;
  * only the adapters train: the final checkpoint holds adapters (and their moments) alone, and
    every tensor of the merged export without an adapter (router, norms, k/v/o, embeddings) is
    the base's, bit for bit;
  * peft.PeftModel.from_pretrained loads the adapter onto the transformers base and its logits
    equal the trainer's own (--lora_adapter --logits_out) to 1e-4 and differ from the base's;
  * the merged export (export/hf-merged) loads in transformers with the same logits.
The first model is fine-tuned again as two processes at expert_parallel 2: the PEFT export,
gathered from both ranks' experts, holds every expert's trained A and B and loads in PEFT with the
trainer's logits. LoRA on the router is refused, naming lora.target_modules.

Exit code 77 (ctest's skip) when transformers or peft is not installed. No downloads.
"""

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile

try:
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file
    from hf_tiny_models import (assert_adapter_only_checkpoint, check_merged_export,
                                check_peft_logits, make_model, run, spec_args,
                                tiny_moe_configs)
except ImportError as error:  # pragma: no cover - depends on the venv
    print(f"SKIP: {error} (scripts/bootstrap.sh installs transformers and peft into the torch "
          "venv)")
    sys.exit(77)

# model: (MoE block name, expert projection names, the spec's target_modules)
CASES = {
    "qwen3_moe": ("mlp", ["gate_proj", "up_proj", "down_proj"],
                  ["q_proj", "gate_proj", "up_proj", "down_proj"]),
    "mixtral": ("block_sparse_moe", ["w1", "w3", "w2"], ["q_proj", "w1", "w3", "w2"]),
}


def train_spec(model_dir, shards, targets, ckpt, job, steps=8):
    return {"name": job, "model": {"from_pretrained": model_dir},
            "data": {"train_shards": [shards], "seq_len": 64}, "max_steps": steps,
            "batch": {"global_batch_size": 4, "micro_batch_size": 2},
            "optimizer": {"schedule": {"peak_learning_rate": 5e-3, "warmup_steps": 1,
                                       "min_lr_ratio": 0.1},
                          "weight_decay": 0.1, "grad_clip_norm": 1.0},
            "lora": {"rank": 4, "alpha": 16, "target_modules": targets},
            "checkpoint": {"directory": ckpt, "export_format": "EXPORT_FORMAT_HF"}}


def check_model(trainer, tmp, name, config, seed, shards, failures):
    block, projections, targets = CASES[name]
    model = make_model(config, seed)
    model_dir = os.path.join(tmp, name)
    model.save_pretrained(model_dir)
    ckpt = os.path.join(tmp, f"{name}_ckpt")
    spec = train_spec(model_dir, shards, targets, ckpt, f"moe-lora-{name}".replace("_", "-"))
    spec["checkpoint"]["export_merged"] = True
    run(trainer, *spec_args(spec))

    # Only adapters (and their moments) are checkpointed: the base is frozen.
    names = assert_adapter_only_checkpoint(sorted(glob.glob(os.path.join(ckpt, "step-*")))[-1])
    assert any(".mlp.experts." in n for n in names), names[:10]

    # An A and a B per expert, layer and projection, each B trained away from zero.
    adapter = os.path.join(ckpt, "export", "hf")
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert sorted(json.load(f)["target_modules"]) == sorted(targets)
    untrained = []
    for layer in range(config.num_hidden_layers):
        for expert in range(len(getattr(model.model.layers[0], block).experts)):
            for projection in projections:
                stem = (f"base_model.model.model.layers.{layer}.{block}.experts.{expert}."
                        f"{projection}")
                for matrix in ("lora_A", "lora_B"):
                    assert f"{stem}.{matrix}.weight" in tensors, f"{stem}.{matrix} missing"
                if not tensors[f"{stem}.lora_B.weight"].abs().max().item() > 0:
                    untrained.append(stem)
    experts = [n for n in tensors if ".experts." in n]
    print(f"{name}: {len(experts)} expert adapter tensors "
          f"({config.num_hidden_layers} layers x {len(projections)} projections x A, B per "
          f"expert); untrained: {len(untrained)}")
    if untrained:
        failures.append(f"{name}: adapters that did not train: {untrained[:4]}")

    peft_logits = check_peft_logits(trainer, tmp, name, model, model_dir, adapter, failures)
    adapted = [f"{p}.weight" for p in projections] + ["q_proj.weight"]
    base_state, merged_state, kept = check_merged_export(
        name, os.path.join(ckpt, "export", "hf-merged"), model_dir, peft_logits, adapted, failures)
    changed = [key for key in kept if not torch.equal(base_state[key], merged_state[key])]
    moved_experts = [key for key in base_state if ".experts." in key
                     and not torch.equal(base_state[key], merged_state[key])]
    print(f"{name}: {len(kept) - len(changed)} of {len(kept)} tensors without an adapter are the "
          f"base's, bit for bit; {len(moved_experts)} expert weights merged")
    if changed or not any(".gate.weight" in key for key in kept):
        failures.append(f"{name}: tensors without an adapter changed: {changed[:5]}")
    if not moved_experts:
        failures.append(f"{name}: no expert weight changed in the merged export")
    return model_dir


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_expert_parallel(trainer, tmp, name, config, seed, model_dir, shards, failures):
    """The same fine-tuning as two processes at expert_parallel 2, each holding half the experts
    and their adapters: the job's PEFT export, gathered from both ranks, still holds an A and a B
    for every expert (each trained), and PEFT's logits with it equal the trainer's."""
    block, projections, targets = CASES[name]
    ckpt = os.path.join(tmp, f"{name}_ep2_ckpt")
    spec = train_spec(model_dir, shards, targets, ckpt, f"moe-lora-{name}-ep2".replace("_", "-"))
    spec["parallelism"] = {"layout": {"expert_parallel": 2}}
    args = [trainer, *spec_args(spec, world=2)]
    port = free_port()
    ranks = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              # One intra-op thread each: two ranks share a small machine.
                              env={**os.environ, "OMP_NUM_THREADS": "1",
                                   "RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    for r, process in enumerate(ranks):
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"ep2 rank {r} failed:\n{err}"
    adapter = os.path.join(ckpt, "export", "hf")
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    missing, untrained = [], []
    for layer in range(config.num_hidden_layers):
        for expert in range(config.num_local_experts if name == "mixtral" else config.num_experts):
            for projection in projections:
                stem = (f"base_model.model.model.layers.{layer}.{block}.experts.{expert}."
                        f"{projection}")
                missing += [m for m in ("lora_A", "lora_B") if f"{stem}.{m}.weight" not in tensors]
                if f"{stem}.lora_B.weight" in tensors and \
                        not tensors[f"{stem}.lora_B.weight"].abs().max().item() > 0:
                    untrained.append(stem)
    print(f"{name} at expert_parallel 2: {len([n for n in tensors if '.experts.' in n])} expert "
          f"adapter tensors gathered from 2 ranks; missing {len(missing)}, untrained "
          f"{len(untrained)}")
    if missing or untrained:
        failures.append(f"{name} ep2: adapters missing {missing[:4]} or untrained {untrained[:4]}")
    check_peft_logits(trainer, tmp, f"{name}_ep2", make_model(config, seed), model_dir, adapter,
                      failures)


def check_refusal(trainer, model_dir, shards):
    spec = train_spec(model_dir, shards, ["gate"], "", "moe-lora-refused", steps=1)
    del spec["checkpoint"]
    result = run(trainer, *spec_args(spec), expect_ok=False)
    assert result.returncode != 0 and "lora.target_modules: 'gate'" in result.stderr, (
        result.stderr)
    print("  router refused as expected:", result.stderr.strip().splitlines()[-1][:160])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--corpus", required=True)
    args = parser.parse_args()
    print(f"transformers {transformers.__version__}, peft {peft.__version__}")
    failures = []
    with tempfile.TemporaryDirectory(prefix="moe_lora_") as tmp:
        data = os.path.join(tmp, "data")
        run(args.trainer, "prepare", f"--input={args.corpus}", f"--output_dir={data}")
        shards = os.path.join(data, "train-*.bin")
        dirs = [check_model(args.trainer, tmp, name, config, seed, shards, failures)
                for seed, (name, config) in enumerate(tiny_moe_configs().items(), start=20)]
        name, config = next(iter(tiny_moe_configs().items()))
        check_expert_parallel(args.trainer, tmp, name, config, 20, dirs[0], shards, failures)
        check_refusal(args.trainer, dirs[0], shards)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
