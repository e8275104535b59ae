#!/usr/bin/env python3
"""Hugging Face interop of tessera-trainer, checked against transformers itself.

For tiny random LlamaForCausalLM (sharded safetensors with an index), Qwen3ForCausalLM and
GPT2LMHeadModel models written by save_pretrained:
  * `--set model.from_pretrained=DIR --logits_out` gives transformers' logits (float32,
    max |diff| <= 1e-4);
  * `--export_hf` writes a directory that AutoModelForCausalLM.from_pretrained loads and that
    gives the same logits again;
  * 20 standalone training steps run from the imported weights (finite, falling loss), and
    under tensor parallel 2 and pipeline parallel 2 (each rank loading only its part) the first
    loss equals that of one process;
For tiny random Qwen3MoeForCausalLM and MixtralForCausalLM models (experts stacked from
per-expert tensors): import logits within 1e-4 of transformers', an export (one tensor per
expert under transformers' names) that transformers loads with logits within 1e-5 of the
original's, 20 training steps with a falling loss and the router's load-balancing loss
reported, and the first loss under data parallel 2 (ZeRO 1 and 3) equal to one process's. Broken inputs (no config.json, an unsupported architecture, a missing tensor, a
truncated safetensors file) fail with messages naming the file and the tensor or field.

A model trained from scratch on the byte tokenizer (tiny-gpt2, tiny-llama: 257 tokens) exports
bos/eos 256, inside its vocabulary, which GenerationConfig.validate(strict=True) accepts and
generate() runs with.

Exit code 77 (ctest's skip) when transformers is not installed. No downloads.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from hf_tiny_models import TOKENS, logits_of, make_model, run, tiny_configs, tiny_moe_configs
    from hf_tiny_models import setting, spec_args
except ImportError as error:  # pragma: no cover - depends on the venv
    print(f"SKIP: {error} (scripts/bootstrap.sh installs transformers into the torch venv)")
    sys.exit(77)

TOLERANCE = 1e-4
MOE_EXPORT_TOLERANCE = 1e-5


def tessera_logits(trainer, init_from, out_file, *extra):
    run(trainer, setting("model.from_pretrained", init_from),
        "--logits_tokens=" + ",".join(map(str, TOKENS)),
        f"--logits_out={out_file}", *extra)
    return load_file(out_file)["logits"]


def expect_failure(trainer, args, *needles):
    result = run(trainer, *args, expect_ok=False)
    message = result.stderr
    assert result.returncode != 0, f"{args} succeeded:\n{result.stdout}"
    for needle in needles:
        assert needle in message, f"{args}: {needle!r} not in:\n{message}"
    print(f"  refused as expected: {message.strip().splitlines()[-1][:200]}")


def check_bad_inputs(trainer, tmp, llama_dir):
    logits_args = ["--logits_tokens=1,2", f"--logits_out={tmp}/bad.safetensors"]
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty)
    expect_failure(trainer, [setting("model.from_pretrained", empty), *logits_args],
                   "model.from_pretrained", f"{empty}/config.json: cannot open")

    mistral = os.path.join(tmp, "mistral")
    os.makedirs(mistral)
    with open(os.path.join(llama_dir, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["MistralForCausalLM"]
    with open(os.path.join(mistral, "config.json"), "w") as f:
        json.dump(config, f)
    expect_failure(trainer, [setting("model.from_pretrained", mistral), *logits_args],
                   f"{mistral}/config.json: architectures", "MistralForCausalLM")

    scaled = os.path.join(tmp, "rope_scaled")
    os.makedirs(scaled)
    config["architectures"] = ["LlamaForCausalLM"]
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    with open(os.path.join(scaled, "config.json"), "w") as f:
        json.dump(config, f)
    expect_failure(trainer, [setting("model.from_pretrained", scaled), *logits_args],
                   "rope_scaling", "llama3")

    # One tensor left out of a single-file checkpoint.
    model = make_model(tiny_configs()["gpt2"], seed=5)
    missing = os.path.join(tmp, "missing_tensor")
    model.save_pretrained(missing)
    tensors = load_file(os.path.join(missing, "model.safetensors"))
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    save_file(tensors, os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
    expect_failure(trainer, [setting("model.from_pretrained", missing), *logits_args],
                   f"{missing}/model.safetensors", "transformer.h.1.mlp.c_fc.weight")

    # A tensor of the wrong shape.
    tensors = load_file(os.path.join(missing, "model.safetensors"))
    tensors["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(64, 100)
    save_file(tensors, os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
    expect_failure(trainer, [setting("model.from_pretrained", missing), *logits_args],
                   "transformer.h.1.mlp.c_fc.weight", "[64, 100]", "[64, 256]")

    truncated = os.path.join(tmp, "truncated")
    model.save_pretrained(truncated)
    path = os.path.join(truncated, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 1000)
    expect_failure(trainer, [setting("model.from_pretrained", truncated), *logits_args], path)


def check_training(trainer, tmp, name, model_dir, corpus, moe_top_k=0):
    data = os.path.join(tmp, "data")
    if not os.path.isdir(data):
        run(trainer, "prepare", f"--input={corpus}", f"--output_dir={data}", "--val_fraction=0.05")
    shards = os.path.join(data, "train-*.bin")
    result = run(trainer, *spec_args({
        "name": f"hf-{name}".replace("_", "-"), "model": {"from_pretrained": model_dir},
        "data": {"train_shards": [shards], "seq_len": 64}, "max_steps": 20,
        "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        "optimizer": {"schedule": {"peak_learning_rate": 1e-3, "warmup_steps": 2,
                                   "min_lr_ratio": 0.1},
                      "weight_decay": 0.1, "grad_clip_norm": 1.0}}))
    losses, aux_losses = [], []
    for line in result.stdout.splitlines():
        if not line.startswith("{"):
            continue
        report = json.loads(line)
        if "metrics" in report:
            losses.append(float(report["metrics"]["loss"]))
            aux_losses.append(float(report["metrics"].get("router_aux_loss", 0)))
    assert len(losses) == 20, f"expected 20 step reports, got {len(losses)}:\n{result.stdout}"
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], f"loss did not fall in 20 steps: {losses}"
    print(f"  {name}: trained 20 steps from the import, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if moe_top_k:
        # The load-balancing loss is top_k when perfectly balanced, more otherwise (at most
        # top_k * num_experts).
        assert all(moe_top_k * 0.99 <= aux for aux in aux_losses), aux_losses
        print(f"  {name}: router aux loss {aux_losses[0]:.4f} -> {aux_losses[-1]:.4f}")
    else:
        assert all(aux == 0 for aux in aux_losses), aux_losses
    return losses


def free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def first_loss(stdout):
    for line in stdout.splitlines():
        if line.startswith("{") and "metrics" in json.loads(line):
            return float(json.loads(line)["metrics"]["loss"])
    raise AssertionError(f"no step report in:\n{stdout}")


def check_sharded_layouts(trainer, tmp, name, model_dir,
                          layouts=({"tensor_parallel": 2}, {"pipeline_parallel": 2},
                                   {"zero_stage": 3})):
    """Each rank of `layouts` (two ranks: tp 2, pp 2, ZeRO dp 2) loads only its part; the first
    loss equals one process's."""
    shards = os.path.join(tmp, "data", "train-*.bin")
    spec = {"name": f"hf-{name}".replace("_", "-"), "model": {"from_pretrained": model_dir},
            "data": {"train_shards": [shards], "seq_len": 64}, "max_steps": 1,
            "batch": {"global_batch_size": 4, "micro_batch_size": 2},
            "optimizer": {"schedule": {"peak_learning_rate": 3e-3, "warmup_steps": 1}}}
    reference = first_loss(run(trainer, *spec_args(spec)).stdout)
    # ZeRO-3 reads only the tensors of each rank's shards, into its shards.
    for layout in layouts:
        port = free_port()
        procs = []
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            layout_args = spec_args({**spec, "parallelism": {"layout": layout}}, world=2)
            procs.append(subprocess.Popen([trainer, *layout_args],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=300) for proc in procs]
        for proc, (out, err) in zip(procs, outputs):
            assert proc.returncode == 0, f"{layout} rank failed:\n{out}\n{err}"
        # Rank 0 reports under tp; under pp the last stage computes the loss but rank 0 reports.
        loss = first_loss(outputs[0][0] + outputs[1][0])
        print(f"  {name} {layout}: first loss {loss:.6f} vs one process {reference:.6f}")
        assert abs(loss - reference) <= 1e-4 * abs(reference), (layout, loss, reference)

    # ZeRO-3 reads the weights after checking every tensor's name and shape: a truncated file
    # still fails naming it.
    truncated = os.path.join(tmp, f"{name}_truncated")
    make_model({**tiny_configs(), **tiny_moe_configs()}[name], seed=5).save_pretrained(truncated)
    path = os.path.join(truncated, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 1000)
    expect_failure(trainer, spec_args({**spec, "model": {"from_pretrained": truncated},
                                       "parallelism": {"layout": {"zero_stage": 3}}}),
                   "model.from_pretrained", path)


def check_scratch_export(trainer, tmp):
    """A model trained from scratch on the byte tokenizer exports token ids of its own vocabulary,
    which transformers' own checks accept (GenerationConfig.validate, strict) and generation
    stops on."""
    failures = []
    for preset in ("tiny-gpt2", "tiny-llama"):
        export_dir = os.path.join(tmp, f"scratch_{preset}")
        run(trainer, setting("model.preset", preset), f"--export_hf={export_dir}")
        config = transformers.AutoConfig.from_pretrained(export_dir)
        generation = transformers.GenerationConfig.from_model_config(config)
        generation.validate(strict=True)
        ids = {name: getattr(config, name, None)
               for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
        print(f"scratch {preset}: vocab {config.vocab_size}, token ids {ids}")
        for name, value in ids.items():
            if value is not None and not 0 <= value < config.vocab_size:
                failures.append(f"scratch {preset}: {name} {value} is outside the vocabulary "
                                f"of {config.vocab_size} tokens")
        if ids["eos_token_id"] != 256:
            failures.append(f"scratch {preset}: eos_token_id {ids['eos_token_id']}, not the byte "
                            "tokenizer's 256")
        model = transformers.AutoModelForCausalLM.from_pretrained(export_dir).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([[72, 105]]), max_new_tokens=4, do_sample=False,
                                 pad_token_id=generation.eos_token_id)
        if out.shape[1] > 6 or int(out.max()) >= config.vocab_size:
            failures.append(f"scratch {preset}: generate gave {out.tolist()}")
    return failures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--corpus", default="")
    args = parser.parse_args()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")

    failures = []
    with tempfile.TemporaryDirectory(prefix="hf_interop_") as tmp:
        dirs = {}
        for seed, (name, config) in enumerate(tiny_configs().items()):
            model = make_model(config, seed)
            model_dir = os.path.join(tmp, name)
            # Llama: sharded, so the index file is read too.
            model.save_pretrained(model_dir, max_shard_size="100KB" if name == "llama" else "5GB")
            dirs[name] = model_dir
            reference = logits_of(model)

            logits = tessera_logits(args.trainer, model_dir, os.path.join(tmp, f"{name}.logits"))
            diff = (logits - reference).abs().max().item()
            print(f"{name}: import max |logit diff| vs transformers = {diff:.3g}")
            if logits.shape != reference.shape or not diff <= TOLERANCE:
                failures.append(f"{name}: import logits differ by {diff} (shape {logits.shape})")

            export_dir = os.path.join(tmp, f"{name}_export")
            run(args.trainer, setting("model.from_pretrained", model_dir),
                f"--export_hf={export_dir}")
            exported = transformers.AutoModelForCausalLM.from_pretrained(export_dir).eval()
            assert type(exported) is type(model), (type(exported), type(model))
            diff = (logits_of(exported) - reference).abs().max().item()
            print(f"{name}: export -> transformers max |logit diff| = {diff:.3g}")
            if not diff <= TOLERANCE:
                failures.append(f"{name}: exported model's logits differ by {diff}")

        for seed, (name, config) in enumerate(tiny_moe_configs().items(), start=10):
            model = make_model(config, seed)
            model_dir = os.path.join(tmp, name)
            model.save_pretrained(model_dir)
            dirs[name] = model_dir
            reference = logits_of(model)
            logits = tessera_logits(args.trainer, model_dir, os.path.join(tmp, f"{name}.logits"))
            diff = (logits - reference).abs().max().item()
            print(f"{name}: import max |logit diff| vs transformers = {diff:.3g}")
            if logits.shape != reference.shape or not diff <= TOLERANCE:
                failures.append(f"{name}: import logits differ by {diff} (shape {logits.shape})")
            # Export writes one tensor per expert under transformers' names; the export loads as
            # the same class and computes the original's logits (the weights are copied, not
            # recomputed, so within 1e-5).
            export_dir = os.path.join(tmp, f"{name}_export")
            run(args.trainer, setting("model.from_pretrained", model_dir),
                f"--export_hf={export_dir}")
            exported = transformers.AutoModelForCausalLM.from_pretrained(export_dir).eval()
            assert type(exported) is type(model), (type(exported), type(model))
            for key in ("num_experts_per_tok", "router_aux_loss_coef", "num_experts",
                        "num_local_experts", "moe_intermediate_size", "norm_topk_prob",
                        "intermediate_size"):
                assert getattr(exported.config, key, None) == getattr(config, key, None), key
            original = load_file(os.path.join(model_dir, "model.safetensors"))
            written = load_file(os.path.join(export_dir, "model.safetensors"))
            assert sorted(written) == sorted(original), \
                sorted(set(written) ^ set(original))
            diff = (logits_of(exported) - reference).abs().max().item()
            print(f"{name}: export -> transformers max |logit diff| = {diff:.3g}")
            if not diff <= MOE_EXPORT_TOLERANCE:
                failures.append(f"{name}: exported model's logits differ by {diff}")

        failures += check_scratch_export(args.trainer, tmp)
        check_bad_inputs(args.trainer, tmp, dirs["llama"])
        if args.corpus:
            for name in ("llama", "gpt2"):
                check_training(args.trainer, tmp, name, dirs[name], args.corpus)
            for name, config in tiny_moe_configs().items():
                check_training(args.trainer, tmp, name, dirs[name], args.corpus,
                               moe_top_k=config.num_experts_per_tok)
            # Mixture of experts: data parallel (ZeRO 1 and 3) only, for now.
            check_sharded_layouts(args.trainer, tmp, "qwen3_moe", dirs["qwen3_moe"],
                                  layouts=({"zero_stage": 1}, {"zero_stage": 3}))
            # Qwen3 ties its embeddings: pp's last stage loads its own copy of them.
            check_sharded_layouts(args.trainer, tmp, "qwen3", dirs["qwen3"])

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
