#!/usr/bin/env python3
"""A job's final export as a Hugging Face directory (checkpoint.export_format EXPORT_FORMAT_HF),
end to end through real tessera-trainer processes, checked against transformers and PEFT.

From tiny random Qwen3ForCausalLM and Qwen3MoeForCausalLM models written by save_pretrained (with
tokenizer files beside them), tessera-trainer trains a few steps with --export_format=hf and:
  * <checkpoint_dir>/export/hf loads with AutoModelForCausalLM.from_pretrained as the same class,
    holds the source's tokenizer files byte for byte, and its logits equal the trainer's own
    logits of the final checkpoint (--weights --logits_out) to 1e-4 and differ from the
    untrained model's (the export is of the trained weights);
  * the dense model trains under ZeRO-3 over two processes, where no rank holds the whole model,
    and still exports (the export is read from the committed checkpoint);
  * with LoRA (and --export_merged), export/hf is the PEFT adapter, which peft.PeftModel loads
    onto the base with the trainer's logits, and export/hf-merged is the merged model with the
    same logits;
  * with QLoRA (--lora_nf4), export/hf-merged is the NF4 base dequantized plus the adapters:
    PEFT's logits on the float32 base up to NF4's rounding, embeddings and norms untouched;
  * --export_merged without LoRA is refused before training, naming checkpoint.export_merged.

Exit code 77 (ctest's skip) when transformers or peft is not installed. No downloads.
"""

import argparse
import filecmp
import glob
import json
import os
import subprocess
import sys
import tempfile

try:
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file
    from hf_tiny_models import TOKENS, logits_of, make_model, run, tiny_configs, tiny_moe_configs
    from hf_tiny_models import setting, spec_args
except ImportError as error:  # pragma: no cover - depends on the venv
    print(f"SKIP: {error} (scripts/bootstrap.sh installs transformers and peft into the torch "
          "venv)")
    sys.exit(77)

TOLERANCE = 1e-4
TOKENIZER_FILES = {"tokenizer_config.json": {"model_max_length": 128, "tokenizer_class": "x"},
                   "special_tokens_map.json": {"eos_token": "<eos>"}}


def write_source(tmp, name, config, seed):
    """A save_pretrained directory with tokenizer files; returns (dir, model)."""
    model = make_model(config, seed)
    model_dir = os.path.join(tmp, name)
    model.save_pretrained(model_dir)
    for file, content in TOKENIZER_FILES.items():
        with open(os.path.join(model_dir, file), "w") as f:
            json.dump(content, f)
    return model_dir, model


def train_spec(model_dir, shards, ckpt, job, lora=None, export_merged=False):
    spec = {"name": job, "model": {"from_pretrained": model_dir},
            "data": {"train_shards": [shards], "seq_len": 64}, "max_steps": 4,
            "batch": {"global_batch_size": 4, "micro_batch_size": 2},
            "optimizer": {"schedule": {"peak_learning_rate": 3e-3, "warmup_steps": 1,
                                       "min_lr_ratio": 0.1},
                          "weight_decay": 0.1, "grad_clip_norm": 1.0},
            "checkpoint": {"directory": ckpt, "export_format": "EXPORT_FORMAT_HF",
                           "export_merged": export_merged}}
    if lora:
        spec["lora"] = lora
    return spec


def run_two_ranks(trainer, spec):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([trainer, *spec_args(spec, world=2)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank failed:\n{out}\n{err}"


def final_checkpoint(ckpt):
    steps = sorted(glob.glob(os.path.join(ckpt, "step-*")))
    assert steps, f"no checkpoint under {ckpt}"
    return steps[-1]


def trainer_logits(trainer, tmp, name, *flags):
    out = os.path.join(tmp, f"{name}.logits")
    run(trainer, *flags, "--logits_tokens=" + ",".join(map(str, TOKENS)), f"--logits_out={out}")
    return load_file(out)["logits"]


def compare(failures, what, ours, theirs, tolerance=TOLERANCE):
    diff = (ours - theirs).abs().max().item()
    print(f"  {what}: max |logit diff| = {diff:.3g}")
    if ours.shape != theirs.shape or not diff <= tolerance:
        failures.append(f"{what}: logits differ by {diff} (shapes {ours.shape}, {theirs.shape})")


def check_full_export(trainer, tmp, name, source, model, shards, failures, two_ranks=False):
    ckpt = os.path.join(tmp, f"{name}_ckpt")
    spec = train_spec(source, shards, ckpt, f"export-{name}".replace("_", "-"))
    if two_ranks:
        run_two_ranks(trainer, {**spec, "parallelism": {"layout": {"zero_stage": 3}}})
    else:
        run(trainer, *spec_args(spec))
    export = os.path.join(ckpt, "export", "hf")
    for file in ("config.json", "model.safetensors", "generation_config.json", *TOKENIZER_FILES):
        assert os.path.isfile(os.path.join(export, file)), f"{export} lacks {file}"
    for file in TOKENIZER_FILES:
        assert filecmp.cmp(os.path.join(source, file), os.path.join(export, file), shallow=False)
    exported = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(exported) is type(model), (type(exported), type(model))
    ours = trainer_logits(trainer, tmp, name, setting("model.from_pretrained", source),
                          f"--weights={final_checkpoint(ckpt)}/model.safetensors")
    print(f"{name}{' (ZeRO-3, 2 ranks)' if two_ranks else ''}: export/hf")
    compare(failures, f"{name}: export/hf vs the trainer", logits_of(exported), ours)
    moved = (logits_of(exported) - logits_of(model)).abs().max().item()
    if not moved > 1e-3:
        failures.append(f"{name}: the export's logits are the untrained model's (moved {moved})")


def check_lora_export(trainer, tmp, name, source, model, shards, failures):
    ckpt = os.path.join(tmp, f"{name}_lora_ckpt")
    run(trainer, *spec_args(train_spec(
        source, shards, ckpt, f"export-lora-{name}".replace("_", "-"),
        lora={"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        export_merged=True)))
    adapter = os.path.join(ckpt, "export", "hf")
    for file in ("adapter_config.json", "adapter_model.safetensors", *TOKENIZER_FILES):
        assert os.path.isfile(os.path.join(adapter, file)), f"{adapter} lacks {file}"
    ours = trainer_logits(trainer, tmp, f"{name}_lora", setting("model.from_pretrained", source),
                          f"--lora_adapter={adapter}")
    base = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    peft_model = peft.PeftModel.from_pretrained(base, adapter).eval()
    print(f"{name}: LoRA export/hf (PEFT adapter) and export/hf-merged")
    compare(failures, f"{name}: PEFT on export/hf vs the trainer", logits_of(peft_model), ours)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(ckpt, "export", "hf-merged")).eval()
    compare(failures, f"{name}: export/hf-merged vs the trainer", logits_of(merged), ours)
    moved = (ours - logits_of(model)).abs().max().item()
    if not moved > 1e-3:
        failures.append(f"{name}: the adapter changed nothing (moved {moved})")


def check_qlora_export(trainer, tmp, name, source, shards, failures):
    """QLoRA's merged export: the NF4 base dequantized, plus the adapters. Its logits equal PEFT's
    on the full-precision base up to NF4's rounding (relative L2 below the bound qlora_test uses),
    and every tensor NF4 leaves alone (embeddings, norms) is the base's bit for bit."""
    ckpt = os.path.join(tmp, f"{name}_qlora_ckpt")
    run(trainer, *spec_args(train_spec(
        source, shards, ckpt, f"export-qlora-{name}".replace("_", "-"),
        lora={"rank": 4, "alpha": 16, "base_quantization": "LORA_BASE_QUANTIZATION_NF4"},
        export_merged=True)))
    adapter = os.path.join(ckpt, "export", "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    peft_logits = logits_of(peft.PeftModel.from_pretrained(base, adapter).eval())
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(ckpt, "export", "hf-merged")).eval()
    merged_logits = logits_of(merged)
    relative = ((merged_logits - peft_logits).norm() / peft_logits.norm()).item()
    print(f"{name}: QLoRA export/hf-merged vs PEFT on the float32 base: relative L2 "
          f"{relative:.3g} (NF4 rounding)")
    if not 0 < relative < 0.3:
        failures.append(f"{name}: QLoRA merged export's logits are {relative} from PEFT's")
    base_state = transformers.AutoModelForCausalLM.from_pretrained(source).state_dict()
    merged_state = merged.state_dict()
    untouched = [k for k in base_state if "norm" in k or "embed" in k]
    changed = [k for k in untouched if not torch.equal(base_state[k], merged_state[k])]
    if not untouched or changed:
        failures.append(f"{name}: QLoRA merged export changed tensors NF4 leaves alone: {changed}")


def check_refusal(trainer, tmp, source, shards):
    result = run(trainer, *spec_args(train_spec(source, shards, os.path.join(tmp, "refused"),
                                                "refused", export_merged=True)),
                 expect_ok=False)
    assert result.returncode != 0, result.stdout
    assert "checkpoint.export_merged" in result.stdout + result.stderr, result.stdout
    assert not os.path.exists(os.path.join(tmp, "refused", "step-00000001")), "trained anyway"
    print("  checkpoint.export_merged without LoRA refused, naming checkpoint.export_merged")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--corpus", required=True)
    args = parser.parse_args()
    print(f"transformers {transformers.__version__}, peft {peft.__version__}")
    failures = []
    with tempfile.TemporaryDirectory(prefix="hf_job_export_") as tmp:
        data = os.path.join(tmp, "data")
        run(args.trainer, "prepare", f"--input={args.corpus}", f"--output_dir={data}",
            "--val_fraction=0.05")
        shards = os.path.join(data, "train-*.bin")
        qwen3, qwen3_model = write_source(tmp, "qwen3", tiny_configs()["qwen3"], seed=1)
        moe, moe_model = write_source(tmp, "qwen3_moe", tiny_moe_configs()["qwen3_moe"], seed=2)
        check_full_export(args.trainer, tmp, "qwen3", qwen3, qwen3_model, shards, failures,
                          two_ranks=True)
        check_full_export(args.trainer, tmp, "qwen3_moe", moe, moe_model, shards, failures)
        check_lora_export(args.trainer, tmp, "qwen3", qwen3, qwen3_model, shards, failures)
        check_qlora_export(args.trainer, tmp, "qwen3", qwen3, shards, failures)
        check_refusal(args.trainer, tmp, qwen3, shards)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
