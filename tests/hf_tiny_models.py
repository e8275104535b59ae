"""Tiny random Hugging Face models, a tessera-trainer runner and the LoRA checks against PEFT,
shared by the Python interop tests (hf_interop_test.py, lora_peft_test.py, hf_moe_lora_test.py,
hf_job_export_test.py). Importing it needs torch and transformers; the tests catch the
ImportError and skip (exit 77). The PEFT checks import peft and safetensors when called."""

import os
import subprocess
import sys

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from trainer_spec import merged, setting, spec_args  # noqa: E402,F401  (re-exported)

# One sequence every test runs the models on (ids below every tiny model's vocabulary).
TOKENS = [3, 17, 250, 42, 0, 99, 128, 7, 255, 1, 64, 200]


def tiny_configs():
    """A tiny Llama (untied, GQA), Qwen3 (tied, explicit head_dim) and GPT-2, by name."""
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, rope_theta=10000.0)
    return {
        "llama": transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        "gpt2": transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4,
                                        n_positions=128, n_inner=None),
    }


def tiny_moe_configs():
    """A tiny Qwen3-MoE (experts in every layer, normalised top-k) and Mixtral, by name: 4
    experts, 2 per token, untied."""
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  rope_theta=10000.0, num_experts_per_tok=2, tie_word_embeddings=False,
                  router_aux_loss_coef=0.01)
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(**common, head_dim=32, intermediate_size=96,
                                                 moe_intermediate_size=48, num_experts=4,
                                                 norm_topk_prob=True),
        "mixtral": transformers.MixtralConfig(**common, intermediate_size=48,
                                              num_local_experts=4),
    }


def make_model(config, seed):
    """A float32 model of `config` in eval mode. Norm weights and biases start at 1 and 0;
    everything is perturbed so that each tensor's mapping (and GPT-2's transposes) shows in the
    logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def logits_of(model, tokens=TOKENS):
    """The model's float32 logits [1, len(tokens), vocab] of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits.float()


def run(trainer, *args, expect_ok=True, env=None):
    """Runs tessera-trainer with `args`; AssertionError with its output when it fails and
    `expect_ok`."""
    result = subprocess.run([trainer, *args], capture_output=True, text=True, timeout=300,
                            env=env)
    if expect_ok and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


# Largest |logit| difference the LoRA checks accept between Tessera and transformers / PEFT.
LORA_TOLERANCE = 1e-4


def assert_adapter_only_checkpoint(step_dir):
    """Asserts that a LoRA run's checkpoint step directory holds only adapters and their AdamW
    moments (the base is frozen); returns the names of those tensors."""
    from safetensors import safe_open
    with safe_open(os.path.join(step_dir, "rank-00000.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.startswith(("model/", "exp_avg/", "exp_avg_sq/"))]
    frozen = [n for n in names if not n.endswith((".lora_a", ".lora_b"))]
    assert names and not frozen, f"checkpoint holds non-adapter tensors: {frozen[:5]}"
    return names


def check_peft_logits(trainer, tmp, name, model, model_dir, adapter, failures):
    """Loads `adapter` with peft.PeftModel onto `model` (the transformers base saved in
    model_dir): its logits must equal the trainer's own with --lora_adapter to LORA_TOLERANCE,
    and the adapters must move them. Appends to `failures`; returns PEFT's logits."""
    import peft
    from safetensors.torch import load_file
    peft_model = peft.PeftModel.from_pretrained(model, adapter).eval()
    peft_logits = logits_of(peft_model)
    ours = os.path.join(tmp, f"{name}_lora.logits")
    run(trainer, setting("model.from_pretrained", model_dir), f"--lora_adapter={adapter}",
        "--logits_tokens=" + ",".join(map(str, TOKENS)), f"--logits_out={ours}")
    diff = (load_file(ours)["logits"] - peft_logits).abs().max().item()
    with peft_model.disable_adapter():
        moved = (logits_of(peft_model) - peft_logits).abs().max().item()
    print(f"{name}: Tessera vs PEFT max |logit diff| = {diff:.3g} (the adapters move the logits "
          f"by up to {moved:.3g})")
    if not diff <= LORA_TOLERANCE:
        failures.append(f"{name}: PEFT logits differ from Tessera's by {diff}")
    if not moved > 10 * LORA_TOLERANCE:
        failures.append(f"{name}: the trained adapters do not change the logits ({moved})")
    return peft_logits


def check_merged_export(name, merged_dir, model_dir, peft_logits, adapted, failures):
    """A merged LoRA export in merged_dir: transformers' logits must equal PEFT's to
    LORA_TOLERANCE (appended to `failures`). Returns the base's and the merged model's state
    dicts and the keys of the base's tensors that no adapter touches (none of their names ends
    in one of `adapted`), for the caller's checks of what the merge kept."""
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    diff = (logits_of(merged) - peft_logits).abs().max().item()
    print(f"{name}: merged export vs PEFT max |logit diff| = {diff:.3g}")
    if not diff <= LORA_TOLERANCE:
        failures.append(f"{name}: merged export's logits differ from PEFT's by {diff}")
    base_state = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    kept = [key for key in base_state if not any(key.endswith(a) for a in adapted)]
    return base_state, merged.state_dict(), kept
