// fused_ops_bench: forward + backward of the model's RMSNorm, LayerNorm, rotary embedding, SwiGLU,
// residual add and head + cross-entropy as the fused CUDA kernels (trainer/kernels/fused_ops.h) against
// the ATen composite the model runs without them (--fused_kernels=false), in the same process on
// the same tensors, in bf16 (the norms: float32 residual in, bf16 out; the residual add: float32
// + bf16) at the shapes of one GPT-2 124M, one Qwen3-0.6B and one Llama-3-8B layer (2,048
// tokens, their vocabulary), and GPT-2's LayerNorm and residual add at a whole micro-batch of
// its measured step (16 x 1,024 tokens); with --cpu, the CPU GELU, SwiGLU and RMSNorm kernels
// against ATen's ops in float32 at 1,024 tokens of width 384 and 768 (MLP 4x). Per op and shape:
// `rounds` rounds, each timing `iterations` forward + backward passes of both paths in alternating
// order (device synchronised before and after); median per path; speedup = composite / fused.
// Writes fused-ops.json (or fused-ops-cpu.json with --cpu; scripts/bench.sh, make bench-gpu, make
// gpu-check).
//
//   fused_ops_bench [--rounds=5] [--iterations=20]   needs a GPU (exit 2 without one)
//   fused_ops_bench --cpu                           the CPU kernels, on ATen's intra-op threads
//   fused_ops_bench --smoke                         tiny shapes on the CPU, every case: checks
//                                                   the benchmark runs

#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "bench/bench_env.h"
#include "common/command_line.h"
#include "nlohmann/json.hpp"
#include "trainer/data/data_loader.h"
#include "trainer/kernels/device.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/kernels/fused_ops_cpu.h"
#include "trainer/model/linear_cross_entropy.h"
#include "trainer/model/model.h"
#include "trainer/torch_pch.h"

ABSL_FLAG(int, rounds, 5, "Rounds per op and shape; the figures are medians over rounds.");
ABSL_FLAG(int, iterations, 20, "Forward + backward passes per path per round.");
ABSL_FLAG(bool, smoke, false,
          "Tiny shapes on the CPU (both paths are the composite there): checks that the "
          "benchmark runs; its times mean nothing.");
ABSL_FLAG(
    bool, cpu, false,
    "Time the CPU kernels (GELU, SwiGLU, RMSNorm, rotary; float32) instead of the CUDA ones.");

namespace tessera::bench {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;
using Tensor = torch::Tensor;

constexpr char kUsage[] =
    "fused_ops_bench: fused RMSNorm / LayerNorm / rotary / SwiGLU / residual add / cross-entropy "
    "CUDA kernels vs "
    "ATen's composite, forward + "
    "backward, bf16 (--cpu: the CPU GELU / SwiGLU / RMSNorm kernels, float32).\n\nUsage: "
    "fused_ops_bench "
    "[--rounds=N] [--iterations=N] [--cpu] [--smoke]";

struct Shape {
  std::string name;
  int64_t tokens, hidden, heads, kv_heads, head_dim, ffn, vocab;
  // Only the ops that a GPT-2 step runs per block at every token (StepCasesFor), at a whole
  // micro-batch: the shape of a measured step's profile.
  bool step_ops_only = false;
};

// One op's forward: the inputs (leaves that require grad where the op has a gradient) to its
// output.
struct Case {
  std::string op;
  std::vector<Tensor> inputs;
  std::function<Tensor(const std::vector<Tensor>&)> forward;
  // Whether the fused path ran, for an op whose autograd node is the same either way; unset:
  // the output's node is one of the fused autograd Functions.
  std::function<bool()> fused_ran = nullptr;
};

// Whether SplitQkv runs its own autograd Function (the output the cases time is a sum of its
// three views, whose node is the add's).
std::function<bool()> SplitQkvRan(const torch::Device& device) {
  return [device] {
    const Tensor qkv =
        torch::zeros({1, 2, 6}, torch::TensorOptions().device(device)).requires_grad_(true);
    const Tensor q = trainer::SplitQkv(qkv, 1, 2)[0];
    return q.grad_fn() != nullptr && q.grad_fn()->name().find("SplitQkv") != std::string::npos;
  };
}

// The CPU kernels' cases, on float32 activations: GELU (tanh) and SwiGLU at [tokens, ffn],
// RMSNorm at [tokens, hidden], GPT-2's q, k, v split and rotary on q as the model calls them (4
// sequences of tokens / 4).
std::vector<Case> CpuCasesFor(const Shape& s) {
  auto leaf = [](Tensor t) { return t.requires_grad_(true); };
  auto [cos, sin] = trainer::RotaryTables(s.tokens / 4, s.head_dim, 1e6);
  return {{"gelu [tokens, ffn] float32",
           {leaf(torch::randn({s.tokens, s.ffn}))},
           [](const std::vector<Tensor>& in) { return trainer::FusedGeluTanh(in[0]); }},
          {"swiglu [tokens, ffn] float32",
           {leaf(torch::randn({s.tokens, s.ffn})), leaf(torch::randn({s.tokens, s.ffn}))},
           [](const std::vector<Tensor>& in) { return trainer::FusedSwiGlu(in[0], in[1]); }},
          {"rms_norm [tokens, hidden] float32",
           {leaf(torch::randn({s.tokens, s.hidden})), leaf(torch::ones({s.hidden}))},
           [](const std::vector<Tensor>& in) { return trainer::FusedRmsNorm(in[0], in[1], 1e-6); }},
          {"split qkv [4, seq, 3 x hidden] -> q + k + v float32",
           {leaf(torch::randn({4, s.tokens / 4, 3 * s.heads * s.head_dim}))},
           [s](const std::vector<Tensor>& in) {
             const std::vector<Tensor> qkv = trainer::SplitQkv(in[0], s.heads, s.head_dim);
             return qkv[0] + qkv[1] + qkv[2];
           },
           SplitQkvRan(torch::kCPU)},
          {"rotary q [4, heads, seq, head_dim] (transposed view) float32",
           {leaf(torch::randn({4, s.tokens / 4, s.heads, s.head_dim})), cos, sin},
           [](const std::vector<Tensor>& in) {
             return trainer::FusedRotary(in[0].transpose(1, 2), in[1], in[2]);
           }}};
}

// The block's residual add under autocast: the float32 residual stream plus a bf16 branch.
Case ResidualAddCase(const Shape& s, const torch::Device& device) {
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  return {"residual add float32 + bf16 [tokens, hidden]",
          {torch::randn({s.tokens, s.hidden}, f32).requires_grad_(true),
           torch::randn({s.tokens, s.hidden}, bf16).requires_grad_(true)},
          [](const std::vector<Tensor>& in) { return trainer::ResidualAdd(in[0], in[1]); }};
}

// GPT-2's per-block norm (float32 in, bf16 out, weight and bias gradients) and residual add.
std::vector<Case> StepCasesFor(const Shape& s, const torch::Device& device) {
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  auto leaf = [](Tensor t) { return t.requires_grad_(true); };
  return {{"layer_norm float32 -> bf16 [tokens, hidden]",
           {leaf(torch::randn({s.tokens, s.hidden}, f32)), leaf(torch::randn({s.hidden}, f32)),
            leaf(torch::randn({s.hidden}, f32))},
           [](const std::vector<Tensor>& in) {
             return trainer::FusedLayerNorm(in[0], in[1], in[2], 1e-5, torch::kBFloat16);
           }},
          ResidualAddCase(s, device)};
}

std::vector<Case> CasesFor(const Shape& s, const torch::Device& device) {
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  auto leaf = [](Tensor t) { return t.requires_grad_(true); };
  auto [cos, sin] = trainer::RotaryTables(s.tokens, s.head_dim, 1e6);
  cos = cos.to(device);
  sin = sin.to(device);
  std::vector<Case> cases;
  // A norm of bf16 activations with a float32 weight.
  cases.push_back({"rms_norm [tokens, hidden]",
                   {leaf(torch::randn({s.tokens, s.hidden}, bf16)), leaf(torch::ones({s.hidden}, f32))},
                   [](const std::vector<Tensor>& in) {
                     return trainer::FusedRmsNorm(in[0], in[1], 1e-6);
                   }});
  // The block's norms as the model runs them under autocast: the float32 residual stream in,
  // autocast's bf16 out (NormImpl's autocast_output; the composite casts after the norm).
  cases.push_back(
      {"rms_norm float32 -> bf16 [tokens, hidden]",
       {leaf(torch::randn({s.tokens, s.hidden}, f32)), leaf(torch::ones({s.hidden}, f32))},
       [](const std::vector<Tensor>& in) {
         return trainer::FusedRmsNorm(in[0], in[1], 1e-6, torch::kBFloat16);
       }});
  cases.push_back({"layer_norm float32 -> bf16 [tokens, hidden]",
                   {leaf(torch::randn({s.tokens, s.hidden}, f32)),
                    leaf(torch::ones({s.hidden}, f32)), leaf(torch::zeros({s.hidden}, f32))},
                   [](const std::vector<Tensor>& in) {
                     return trainer::FusedLayerNorm(in[0], in[1], in[2], 1e-5, torch::kBFloat16);
                   }});
  // Qwen3's per-head q norm.
  cases.push_back({"rms_norm q heads [1, seq, heads, head_dim]",
                   {leaf(torch::randn({1, s.tokens, s.heads, s.head_dim}, bf16)),
                    leaf(torch::ones({s.head_dim}, f32))},
                   [](const std::vector<Tensor>& in) {
                     return trainer::FusedRmsNorm(in[0], in[1], 1e-6);
                   }});
  // Rotary on q as the model calls it: q [1, seq, heads, head_dim] seen heads first.
  cases.push_back({"rotary q [1, heads, seq, head_dim] (transposed view)",
                   {leaf(torch::randn({1, s.tokens, s.heads, s.head_dim}, bf16)), cos, sin},
                   [](const std::vector<Tensor>& in) {
                     return trainer::FusedRotary(in[0].transpose(1, 2), in[1], in[2]);
                   }});
  // GPT-2's q, k, v out of the fused projection (both sides add the three, forward and
  // backward alike; the difference is how the projection's gradient is assembled).
  cases.push_back({"split qkv [1, seq, 3 x hidden] -> q + k + v",
                   {leaf(torch::randn({1, s.tokens, 3 * s.heads * s.head_dim}, bf16))},
                   [s](const std::vector<Tensor>& in) {
                     const std::vector<Tensor> qkv = trainer::SplitQkv(in[0], s.heads, s.head_dim);
                     return qkv[0] + qkv[1] + qkv[2];
                   },
                   SplitQkvRan(device)});
  cases.push_back(ResidualAddCase(s, device));
  cases.push_back({"swiglu [tokens, ffn]",
                   {leaf(torch::randn({s.tokens, s.ffn}, bf16)),
                    leaf(torch::randn({s.tokens, s.ffn}, bf16))},
                   [](const std::vector<Tensor>& in) { return trainer::FusedSwiGlu(in[0], in[1]); }});
  // The head and its loss (trainer/model/linear_cross_entropy.h): the fused path is its cross-entropy
  // kernel, the composite float32 log_softmax and its backward; the chunked matrix products are
  // the same on both sides. Every eighth target ignored, as a loss mask would.
  Tensor targets = torch::randint(0, s.vocab, {s.tokens}, torch::kInt64);
  targets.index_put_({torch::arange(0, s.tokens, 8)}, trainer::kIgnoreTarget);
  targets = targets.to(device);
  cases.push_back(
      {"linear + cross-entropy [tokens, vocab]",
       {leaf(torch::randn({s.tokens, s.hidden}, bf16)),
        leaf(torch::randn({s.vocab, s.hidden}, bf16) * 0.02), targets},
       [](const std::vector<Tensor>& in) {
         return trainer::LinearCrossEntropy(in[0], in[1], in[2]);
       },
       [device] {
         Tensor probe = torch::zeros({1, 8}, torch::TensorOptions().device(device));
         const Tensor target = torch::zeros({1}, torch::TensorOptions()
                                                     .dtype(torch::kInt64)
                                                     .device(device));
         return trainer::FusedCrossEntropyRows(probe, target,
                                               torch::ones({}, probe.options()),
                                               trainer::kIgnoreTarget, false)
             .has_value();
       }});
  return cases;
}

void Synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Seconds per forward + backward, over `iterations` passes.
double TimePasses(const Case& c, const Tensor& grad, int iterations, const torch::Device& device) {
  Synchronize(device);
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    // Every pass writes fresh gradients, as a step's first backward does.
    for (Tensor input : c.inputs) input.mutable_grad() = Tensor();
    Tensor out = c.forward(c.inputs);
    out.backward(grad);
  }
  Synchronize(device);
  return std::chrono::duration<double>(Clock::now() - start).count() / iterations;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

int Run(bool smoke, bool cpu, int rounds, int iterations) {
  const bool gpu = !cpu && trainer::CudaDeviceCount() > 0;
  if (!gpu && !smoke && !cpu) {
    std::cerr << "fused_ops_bench: no CUDA device visible (the fused kernels run on GPUs only; "
                 "--smoke runs the benchmark's code on the CPU)\n";
    return 2;
  }
  const torch::Device device = gpu && !smoke ? torch::Device(torch::kCUDA, 0) : torch::kCPU;
  const std::vector<Shape> shapes =
      smoke ? std::vector<Shape>{{"tiny", 64, 64, 4, 2, 16, 128, 1000},
                                 {"tiny step", 64, 64, 4, 2, 16, 128, 1000, true}}
      : cpu ? std::vector<Shape>{{"width 384", 1024, 384, 6, 6, 64, 1536, 257},
                                 {"width 768", 1024, 768, 12, 12, 64, 3072, 50257}}
            : std::vector<Shape>{
                  {"gpt2-124m layer", 2048, 768, 12, 12, 64, 3072, 50257},
                  {"qwen3-0.6b layer", 2048, 1024, 16, 8, 128, 3072, 151936},
                  {"llama3-8b layer", 2048, 4096, 32, 8, 128, 14336, 128256},
                  {"gpt2-124m micro-batch", 16384, 768, 12, 12, 64, 3072, 50257, true}};
  const Provenance provenance = ReadProvenance();
  Json json;
  json["benchmark"] = "fused-ops";
  json["device"] = device.is_cuda() ? "cuda" : "cpu";
  json["smoke"] = smoke;
  json["cpu_threads"] = at::get_num_threads();
  // Whether the CPU kernels split their work over those threads (a build that links LibTorch's
  // OpenMP runtime), and which instruction set's variant they ran.
  json["cpu_kernels_parallel"] = trainer::cpu_kernels::CpuKernelsParallel();
  switch (trainer::cpu_kernels::BestIsa()) {
    case trainer::cpu_kernels::Isa::kAvx512:
      json["cpu_kernels_isa"] = "avx512";
      break;
    case trainer::cpu_kernels::Isa::kAvx2:
      json["cpu_kernels_isa"] = "avx2";
      break;
    case trainer::cpu_kernels::Isa::kBaseline:
      json["cpu_kernels_isa"] = "baseline";
      break;
  }
  json["fused_kernels_built"] = trainer::FusedKernelsBuilt();
  json["commit"] = provenance.commit;
  json["date"] = provenance.date;
  json["machine"] = provenance.machine;
  json["method"] =
      "Per op and shape, after one untimed round: rounds x (iterations forward + backward passes "
      "of the fused path and of the composite, in alternating order, device synchronised before "
      "and after each batch of passes); seconds per pass = batch time / iterations; medians over "
      "rounds; speedup = composite median / fused median. CUDA: bf16 activations, float32 norm "
      "weights; CPU: float32. Gradients of every input that takes one.";
  json["rounds"] = rounds;
  json["iterations"] = iterations;
  std::cout << absl::StrFormat("fused_ops_bench on %s: %d rounds x %d passes per path\n",
                               device.str(), rounds, iterations);
  torch::manual_seed(3);
  bool fused_ran_everywhere = true;
  for (const Shape& shape : shapes) {
    std::vector<Case> cases;
    if (!cpu) cases = shape.step_ops_only ? StepCasesFor(shape, device) : CasesFor(shape, device);
    if ((cpu || smoke) && !shape.step_ops_only) {
      for (Case& c : CpuCasesFor(shape)) cases.push_back(std::move(c));
    }
    for (const Case& c : cases) {
      Tensor probe = c.forward(c.inputs);
      const Tensor grad = torch::randn_like(probe);
      const std::string node = probe.grad_fn() ? probe.grad_fn()->name() : "";
      const bool fused_ran =
          c.fused_ran ? c.fused_ran() : node.find("Function") != std::string::npos;
      fused_ran_everywhere = fused_ran_everywhere && (fused_ran || !device.is_cuda());
      probe = Tensor();
      std::vector<double> fused, composite;
      for (int round = -1; round < rounds; ++round) {
        for (bool fused_path : {round % 2 == 0, round % 2 != 0}) {
          trainer::SetFusedKernelsEnabled(fused_path);
          const double seconds = TimePasses(c, grad, iterations, device);
          if (round >= 0) (fused_path ? fused : composite).push_back(seconds);
        }
      }
      trainer::SetFusedKernelsEnabled(true);
      const double f = Median(fused), ref = Median(composite);
      json["results"].push_back({{"shape", shape.name},
                                 {"op", c.op},
                                 {"fused_node", node},
                                 {"fused_ran", fused_ran},
                                 {"fused_seconds", f},
                                 {"composite_seconds", ref},
                                 {"speedup", ref / f},
                                 {"fused_runs", fused},
                                 {"composite_runs", composite}});
      std::cout << absl::StrFormat("  %-18s %-52s fused %9.1f us  composite %9.1f us  %.2fx%s\n",
                                   shape.name, c.op, 1e6 * f, 1e6 * ref, ref / f,
                                   fused_ran ? "" : " (composite on both sides)");
    }
  }
  // Next to the binary unless scripts/bench.sh says where (TESSERA_BENCH_RESULTS).
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  const std::string dir = ResultsDir(error ? "results" : (self.parent_path() / "results").string());
  std::filesystem::create_directories(dir, error);
  const std::string path = dir + (cpu ? "/fused-ops-cpu.json" : "/fused-ops.json");
  std::ofstream out(path);
  out << json.dump(1) << "\n";
  if (!out) {
    std::cerr << "fused_ops_bench: cannot write " << path << "\n";
    return 1;
  }
  std::cout << "wrote " << path << "\n";
  if (!fused_ran_everywhere) {
    std::cerr << "fused_ops_bench: a CUDA case ran the composite: the fused kernels did not run\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  tessera::ParseCommandLine(argc, argv, tessera::bench::kUsage);
  return tessera::bench::Run(absl::GetFlag(FLAGS_smoke), absl::GetFlag(FLAGS_cpu),
                             std::max(1, absl::GetFlag(FLAGS_rounds)),
                             std::max(1, absl::GetFlag(FLAGS_iterations)));
}
