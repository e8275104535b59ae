"""Tiny random Hugging Face models and a tessera-trainer runner, shared by the Python interop
tests (hf_interop_test.py, lora_peft_test.py). Importing it needs torch and transformers; the
tests catch the ImportError and skip (exit 77)."""

import subprocess

import torch
import transformers

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
