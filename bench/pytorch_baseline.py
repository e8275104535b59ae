#!/usr/bin/env python3
"""The PyTorch eager baseline of the trainer benchmark: a plain training script that trains the
same model as tessera-trainer, from the same initial weights, on the same samples in the same
order, with the same optimizer, schedule, clipping and precision, and times its steps the same way.

    python bench/pytorch_baseline.py --config=RUN.json

RUN.json (written by bench/trainer_bench.py) holds:
  init               safetensors file from `tessera-trainer --export_initial`: the initial weights,
                     and in its metadata the resolved model ("tessera.dims") and its size
  train_shards       token shard paths or globs (trainer/data/token_shard.h)
  seq_len, global_batch_size, micro_batch_size, steps, seed
  lr                 {peak, warmup_steps, min_lr_ratio, decay_steps} (planner/lr_schedule.cc)
  weight_decay, beta1, beta2, eps, grad_clip
  device             "cpu" or "cuda"
  precision          "fp32" or "bf16" (bf16 autocast, CUDA only; parameters stay float32)
  threads            intra-op threads
  compile            optional; true: the forward and loss through torch.compile
  profile_dir        optional; record steps profile_steps = [first, count] (1-based) with
                     torch.profiler (CPU operators, and CUDA kernels on a GPU) and write the
                     Chrome trace to profile_dir/trace-pytorch.json, each step marked
                     "train_step" as the trainer's --profile_dir marks it
                     (bench/profile_summary.py compares the two)

Prints one JSON object per line on stdout, shaped like the trainer's reports: {"started": ...},
one {"metrics": ...} per step, {"finished": ...}. Only the standard library and torch are used.

What mirrors which part of the trainer:
  CausalLM            trainer/model/model.cc (GPT-2 and Llama/Qwen3 blocks; parameter names match, so
                      the exported weights load with strict=True)
  TokenSamples, BatchLoader, epoch_permutation
                      trainer/data/data_loader.cc (windows of seq_len + 1 tokens, the seeded
                      Fisher-Yates order over std::mt19937_64, steps of global_batch_size samples)
  learning_rate_at    planner/lr_schedule.cc
  train_step          trainer/runtime/train.cc TrainStep: micro-batches with gradient accumulation, loss
                      in float32, clip_grad_norm_, fused AdamW with decay on tensors of dim >= 2
                      (trainer/engine/adamw.cc), gradients set to None
"""

import argparse
import glob
import json
import math
import mmap
import os
import resource
import struct
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

# --- initial weights --------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(path):
    """Returns (tensors by name, metadata) of a safetensors file: an 8-byte little-endian header
    length N, N bytes of JSON, then the data section. Tensors are CPU views of a private
    (copy-on-write) mapping of the file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    metadata = header.pop("__metadata__", {})
    data_offset = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        count = math.prod(entry["shape"])
        element = torch.empty((), dtype=dtype).element_size()
        if end - begin != count * element:
            raise ValueError(f"{path}: tensor {name}: {end - begin} bytes for shape "
                             f"{entry['shape']}")
        flat = (torch.frombuffer(mapping, dtype=dtype, count=count, offset=data_offset + begin)
                if count else torch.empty(0, dtype=dtype))
        tensors[name] = flat.view(entry["shape"])
    return tensors, metadata


# --- model (trainer/model/model.cc) -----------------------------------------------------------------


def rotary_tables(max_seq_len, head_dim, theta):
    """Computed on the CPU in float64, as the trainer does, then cast to float32."""
    f64, cpu = torch.float64, torch.device("cpu")
    inv_freq = torch.pow(theta, -torch.arange(0, head_dim, 2, dtype=f64, device=cpu) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=f64, device=cpu), inv_freq)
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x):
    half = x.size(-1) // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def apply_rotary(x, cos, sin):
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def rms_norm(x, weight, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


class Norm(nn.Module):
    def __init__(self, size, eps, rms):
        super().__init__()
        self.eps = eps
        self.rms = rms
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = None if rms else nn.Parameter(torch.zeros(size))

    def forward(self, x):
        if self.rms:
            return rms_norm(x, self.weight, self.eps)
        return F.layer_norm(x.float(), (self.weight.size(0),), self.weight, self.bias,
                            self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.llama = dims["architecture"] == "ARCHITECTURE_LLAMA"
        self.heads = dims["num_attention_heads"]
        self.kv_heads = dims["num_kv_heads"]
        self.head_dim = dims["head_dim"]
        d = dims["hidden_size"]
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.llama:
            self.q = nn.Linear(d, q_width, bias=False)
            self.k = nn.Linear(d, kv_width, bias=False)
            self.v = nn.Linear(d, kv_width, bias=False)
            self.o = nn.Linear(q_width, d, bias=False)
            self.q_norm = self.k_norm = None
            if dims["qk_norm"]:
                self.q_norm = Norm(self.head_dim, dims["norm_eps"], rms=True)
                self.k_norm = Norm(self.head_dim, dims["norm_eps"], rms=True)
        else:
            self.qkv = nn.Linear(d, 3 * q_width, bias=True)
            self.proj = nn.Linear(q_width, d, bias=True)

    def forward(self, x, cos, sin):
        batch, seq = x.size(0), x.size(1)
        if self.llama:
            q = self.q(x).view(batch, seq, self.heads, self.head_dim)
            k = self.k(x).view(batch, seq, self.kv_heads, self.head_dim)
            v = self.v(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
            if self.q_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rotary(q.transpose(1, 2), cos, sin)
            k = apply_rotary(k.transpose(1, 2), cos, sin)
            out_proj = self.o
        else:
            qkv = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            out_proj = self.proj
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.kv_heads != self.heads)
        return out_proj(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class Mlp(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.llama = dims["architecture"] == "ARCHITECTURE_LLAMA"
        d, f = dims["hidden_size"], dims["ffn_hidden_size"]
        if self.llama:
            self.gate = nn.Linear(d, f, bias=False)
            self.up = nn.Linear(d, f, bias=False)
            self.down = nn.Linear(f, d, bias=False)
        else:
            self.fc = nn.Linear(d, f, bias=True)
            self.proj = nn.Linear(f, d, bias=True)

    def forward(self, x):
        if self.llama:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dims):
        super().__init__()
        rms = dims["architecture"] == "ARCHITECTURE_LLAMA"
        self.attn_norm = Norm(dims["hidden_size"], dims["norm_eps"], rms)
        self.attn = Attention(dims)
        self.mlp_norm = Norm(dims["hidden_size"], dims["norm_eps"], rms)
        self.mlp = Mlp(dims)

    def forward(self, x, cos, sin):
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class CausalLM(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims
        d, vocab = dims["hidden_size"], dims["vocab_size"]
        llama = dims["architecture"] == "ARCHITECTURE_LLAMA"
        self.lm_head = None if dims["tie_embeddings"] else nn.Parameter(torch.empty(vocab, d))
        self.embed = nn.Embedding(vocab, d)
        self.pos_embed = None if llama else nn.Embedding(dims["max_seq_len"], d)
        self.layers = nn.ModuleList(Block(dims) for _ in range(dims["num_layers"]))
        self.final_norm = Norm(d, dims["norm_eps"], llama)
        if llama:
            cos, sin = rotary_tables(dims["max_seq_len"], dims["head_dim"], dims["rope_theta"])
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        seq = tokens.size(1)
        h = self.embed(tokens)
        cos = sin = None
        if self.pos_embed is not None:
            h = h + self.pos_embed.weight[:seq]
        else:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.final_norm(h)
        return F.linear(h, self.lm_head if self.lm_head is not None else self.embed.weight)

    def loss(self, inputs, targets):
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


# --- data (trainer/data/token_shard.h, trainer/data/data_loader.cc) -------------------------------------

_SHARD_MAGIC = b"TSRSHRD1"
_SHARD_HEADER_BYTES = 64


def read_token_shard(path):
    """Tokens of one shard as an int64 tensor."""
    with open(path, "rb") as f:
        header = f.read(_SHARD_HEADER_BYTES)
        magic, version, token_bytes, num_tokens, vocab_size = struct.unpack_from("<8sIIQI", header)
        if magic != _SHARD_MAGIC or version != 1 or token_bytes not in (2, 4):
            raise ValueError(f"{path}: not a version 1 token shard")
        data = bytearray(f.read(num_tokens * token_bytes))
    if len(data) != num_tokens * token_bytes:
        raise ValueError(f"{path}: truncated: header says {num_tokens} tokens")
    dtype = torch.uint16 if token_bytes == 2 else torch.int32
    tokens = torch.frombuffer(data, dtype=dtype) if num_tokens else torch.empty(0, dtype=dtype)
    return tokens.to(torch.int64), vocab_size


class TokenSamples:
    """Every shard cut into windows of seq_len + 1 tokens, shard tails dropped; sample i of shard k
    follows every sample of shards 0..k-1. Shard paths are sorted and deduplicated."""

    def __init__(self, patterns, seq_len):
        paths = set()
        for pattern in patterns:
            matches = glob.glob(pattern) if any(c in pattern for c in "*?[") else [pattern]
            if not matches:
                raise ValueError(f"train_shards: pattern '{pattern}' matches no file")
            paths.update(matches)
        window = seq_len + 1
        parts = []
        for path in sorted(paths):
            tokens, _ = read_token_shard(path)
            usable = tokens.numel() // window * window
            parts.append(tokens[:usable].view(-1, window))
        self.windows = torch.cat(parts)
        if self.windows.size(0) == 0:
            raise ValueError("train_shards: no sample of seq_len + 1 tokens")

    def __len__(self):
        return self.windows.size(0)


_MASK64 = (1 << 64) - 1


class Mt19937_64:
    """std::mt19937_64: the 64-bit Mersenne Twister with the C++ standard's parameters."""

    _N, _M = 312, 156
    _MATRIX_A = 0xB5026F5AA96619E9
    _UPPER, _LOWER = 0xFFFFFFFF80000000, 0x7FFFFFFF

    def __init__(self, seed):
        state = [seed & _MASK64]
        for i in range(1, self._N):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
        self._state = state
        self._index = self._N

    def _twist(self):
        state, n, m = self._state, self._N, self._M
        for i in range(n):
            y = (state[i] & self._UPPER) | (state[(i + 1) % n] & self._LOWER)
            state[i] = state[(i + m) % n] ^ (y >> 1) ^ (self._MATRIX_A if y & 1 else 0)
        self._index = 0

    def __call__(self):
        if self._index >= self._N:
            self._twist()
        x = self._state[self._index]
        self._index += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x


def _mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def epoch_permutation(num_samples, seed, epoch):
    """The sample order of an epoch, as trainer/data/data_loader.cc's EpochPermutation computes it."""
    generator = Mt19937_64(_mix64(seed ^ _mix64(epoch & _MASK64)))
    order = list(range(num_samples))
    for i in range(num_samples, 1, -1):
        threshold = (1 << 64) % i  # rejecting draws below it keeps the draw unbiased
        while True:
            r = generator()
            if r >= threshold:
                break
        j = r % i
        order[i - 1], order[j] = order[j], order[i - 1]
    return torch.tensor(order, dtype=torch.int64)


class BatchLoader:
    """One process's view of trainer/data/data_loader.cc's BatchLoader (dp_size 1): each step takes the
    next global_batch_size samples of the epoch's order, cut into micro-batches; an epoch that
    cannot fill a whole step is left for the next."""

    def __init__(self, samples, global_batch_size, micro_batch_size, seed):
        if global_batch_size % micro_batch_size != 0:
            raise ValueError("global_batch_size must be divisible by micro_batch_size")
        if global_batch_size > len(samples):
            raise ValueError(f"global_batch_size {global_batch_size} exceeds the "
                             f"{len(samples)} samples")
        self.samples = samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.epoch = 0
        self.samples_in_epoch = 0
        self._order = None
        self._order_epoch = -1

    def next_step(self):
        """[(inputs, targets)], int64 CPU tensors [micro_batch_size, seq_len], one per
        micro-batch."""
        if self._order_epoch != self.epoch:
            self._order = epoch_permutation(len(self.samples), self.seed, self.epoch)
            self._order_epoch = self.epoch
        begin = self.samples_in_epoch
        rows = self._order[begin:begin + self.global_batch_size]
        windows = self.samples.windows[rows]
        self.samples_in_epoch += self.global_batch_size
        if self.samples_in_epoch + self.global_batch_size > len(self.samples):
            self.epoch += 1
            self.samples_in_epoch = 0
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous())
                for w in windows.split(self.micro_batch_size)]


# --- schedule (planner/lr_schedule.cc) ---------------------------------------------------------


def learning_rate_at(schedule, max_steps, step):
    """Linear warmup to the peak, cosine decay to min_lr_ratio * peak, then flat; step 1-based."""
    peak, warmup = schedule["peak"], schedule["warmup_steps"]
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    decay_end = schedule["decay_steps"] if schedule["decay_steps"] > 0 else max_steps
    floor = peak * schedule["min_lr_ratio"]
    if step >= decay_end or decay_end <= warmup:
        return floor
    progress = (step - warmup) / (decay_end - warmup)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --- training ---------------------------------------------------------------------------------


def emit(record):
    print(json.dumps(record), flush=True)


def train_step(loss_fn, params, optimizer, loader, device, bf16, grad_clip, lr):
    """One optimizer step; returns (loss averaged over micro-batches, gradient norm)."""
    micro_batches = loader.next_step()
    accumulation = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(inputs, targets)
        (loss / accumulation).backward()
        loss_sum += loss.detach().float()
    loss_value = (loss_sum / accumulation).item()
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"loss is {loss_value}")
    max_norm = grad_clip if grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, grad_norm


def run(config):
    start = time.perf_counter()
    torch.set_num_threads(config["threads"])
    device = torch.device(config["device"])
    bf16 = config["precision"] == "bf16"
    if bf16 and device.type != "cuda":
        raise ValueError("precision bf16 needs a CUDA device; use fp32 on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)

    weights, metadata = read_safetensors(config["init"])
    dims = json.loads(metadata["tessera.dims"])
    with torch.device(device):
        model = CausalLM(dims)
    model.to(device)  # the rotary tables were built on the CPU
    model.load_state_dict(weights, strict=True)
    del weights
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config["weight_decay"]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=config["lr"]["peak"], betas=(config["beta1"], config["beta2"]), eps=config["eps"],
        fused=True)

    # "compile": the forward and loss through torch.compile (default mode, Inductor), the
    # baseline `make gpu-check` measures next to eager; its compilation falls in the untimed
    # first steps.
    loss_fn = torch.compile(model.loss) if config.get("compile") else model.loss

    samples = TokenSamples(config["train_shards"], config["seq_len"])
    loader = BatchLoader(samples, config["global_batch_size"], config["micro_batch_size"],
                         config["seed"])
    tokens_per_step = config["global_batch_size"] * config["seq_len"]
    emit({"started": {"num_parameters": sum(p.numel() for p in params),
                      "device": str(device) if device.type == "cpu" else
                      f"{device} ({torch.cuda.get_device_name(device)})",
                      "threads": torch.get_num_threads(),
                      "torch_version": torch.__version__,
                      "compiled": bool(config.get("compile")),
                      "startup_seconds": time.perf_counter() - start}})

    steps = config["steps"]
    profile = StepProfile(config, device)
    loss = 0.0
    for step in range(1, steps + 1):
        profile.before_step(step)
        # Timed as trainer/runtime/train.cc times a step: from choosing the learning rate to the
        # optimizer step and zero_grad, without a device synchronisation at the end.
        step_start = time.perf_counter()
        with torch.profiler.record_function("train_step"):
            lr = learning_rate_at(config["lr"], steps, step)
            loss, grad_norm = train_step(loss_fn, params, optimizer, loader, device, bf16,
                                         config["grad_clip"], lr)
        seconds = time.perf_counter() - step_start
        profile.after_step(step, step == steps)
        if device.type == "cuda":
            peak_memory = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            peak_memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        emit({"metrics": {"step": step, "loss": loss, "grad_norm": grad_norm,
                          "learning_rate": lr, "step_time_seconds": seconds,
                          "tokens_per_second": tokens_per_step / seconds,
                          "peak_memory_bytes": peak_memory}})
    emit({"finished": {"final_step": steps, "final_loss": loss}})


class StepProfile:
    """torch.profiler over config["profile_steps"] = [first, count], as trainer/runtime/step_profiler.cc
    records the trainer's steps; nothing without config["profile_dir"]."""

    def __init__(self, config, device):
        self.directory = config.get("profile_dir")
        self.first, self.count = config.get("profile_steps", [3, 3])
        self.device = device
        self.profiler = None

    def before_step(self, step):
        if self.directory and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def after_step(self, step, last):
        if self.profiler is None or (step < self.first + self.count - 1 and not last):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profiler.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        self.profiler.export_chrome_trace(os.path.join(self.directory, "trace-pytorch.json"))
        self.profiler = None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run configuration (JSON)")
    args = parser.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    try:
        run(config)
    except (ValueError, KeyError, FloatingPointError, RuntimeError) as e:
        print(f"pytorch_baseline: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
