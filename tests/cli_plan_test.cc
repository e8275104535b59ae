// `tessera plan` as people run it: the real binary, offline (no coordinator), JSON and text output,
// and bad flags.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/subprocess.h"

namespace tessera {
namespace {

using ::tessera::testing::BinDir;
using ::tessera::testing::RunCommand;
using ::tessera::testing::RunResult;
using ::testing::HasSubstr;

RunResult Plan(std::vector<std::string> args) {
  args.insert(args.begin(), {BinDir() + "/tessera", "plan"});
  auto result = RunCommand(args);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : RunResult{};
}

TEST(CliPlanTest, OfflineJsonListsLayoutsWithEveryTerm) {
  RunResult run = Plan({"--model", "llama3-8b", "--seq-len", "4096", "--global-batch", "64",
                        "--precision", "bf16", "--gpus", "16", "--gpus-per-node", "8",
                        "--gpu-memory", "80GiB", "--max-candidates", "20000", "--output", "json"});
  ASSERT_EQ(run.exit.exit_code, 0) << run.output;
  const nlohmann::json doc = nlohmann::json::parse(run.output);
  EXPECT_TRUE(doc["fits"].get<bool>());
  EXPECT_EQ(doc["model"]["parameters"].get<int64_t>(), 8030261248);
  EXPECT_EQ(doc["cluster"]["devices"].get<int>(), 16);
  EXPECT_EQ(doc["cluster"]["device"]["memory_bytes"].get<int64_t>(), int64_t{80} << 30);
  const auto& layouts = doc["layouts"];
  ASSERT_GT(layouts.size(), 100u);
  bool saw_rejected = false;
  double previous = 1e30;
  for (const auto& layout : layouts) {
    for (const char* key : {"dp", "tp", "pp", "cp", "ep", "v", "zero", "micro_batch", "grad_accum",
                            "sp", "ac", "fits"}) {
      ASSERT_TRUE(layout.contains(key)) << key << " in " << layout.dump();
    }
    if (layout["fits"].get<bool>()) {
      EXPECT_FALSE(saw_rejected) << "fitting layouts come first";
      for (const char* key :
           {"weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
            "logits_bytes", "communication_bytes", "overhead_bytes", "peak_bytes"}) {
        EXPECT_TRUE(layout["memory"].contains(key)) << key;
      }
      EXPECT_LE(layout["memory"]["peak_bytes"].get<int64_t>(),
                layout["memory"]["usable_bytes"].get<int64_t>());
      const double tokens = layout["est_tokens_per_s"].get<double>();
      EXPECT_LE(tokens, previous);
      previous = tokens;
      EXPECT_GT(layout["est_step_time_s"].get<double>(), 0);
      EXPECT_GT(layout["est_mfu"].get<double>(), 0);
      if (layout["pp"].get<int>() > 1) {
        EXPECT_TRUE(layout["memory"].contains("stages"));
      }
    } else {
      saw_rejected = true;
      EXPECT_FALSE(layout["reason"].get<std::string>().empty()) << layout.dump();
    }
  }
  EXPECT_TRUE(saw_rejected);
}

TEST(CliPlanTest, SevenBillionOnOneGpuDoesNotFitAndSaysByHowMuch) {
  RunResult run = Plan({"--model=qwen3-8b", "--seq_len=2048", "--global_batch=8", "--gpus=1",
                        "--device=h100-sxm", "--layout=ac=full"});
  EXPECT_EQ(run.exit.exit_code, 1);
  EXPECT_THAT(run.output, HasSubstr("does not fit: needs"));
  EXPECT_THAT(run.output, HasSubstr("over by"));
  EXPECT_THAT(run.output, HasSubstr("No layout fits"));
}

TEST(CliPlanTest, ExampleSpecAndAnExplicitLayout) {
  RunResult run = Plan({std::string(TESSERA_EXAMPLES_DIR) + "/llama3-8b.yaml", "--device=h100-sxm",
                        "--output=json"});
  ASSERT_EQ(run.exit.exit_code, 0) << run.output;
  const nlohmann::json doc = nlohmann::json::parse(run.output);
  ASSERT_GE(doc["layouts"].size(), 1u);
  const auto& layout = doc["layouts"][0];
  // The example's layout: tensor parallel 2 with sequence parallelism inside a node, data
  // parallel 32 with ZeRO-1, selective recomputation.
  EXPECT_EQ(layout["dp"].get<int>(), 32);
  EXPECT_EQ(layout["tp"].get<int>(), 2);
  EXPECT_EQ(layout["pp"].get<int>(), 1);
  EXPECT_EQ(layout["zero"].get<int>(), 1);
  EXPECT_TRUE(layout["sp"].get<bool>());
  EXPECT_EQ(layout["ac"].get<std::string>(), "selective");
  EXPECT_TRUE(layout["fits"].get<bool>());
  EXPECT_THAT(doc["explanation"].get<std::string>(), HasSubstr("Explicit layout"));
  // Flags override the spec's layout: data parallel only needs ZeRO-2 and full recomputation to
  // fit, and is estimated slower.
  run = Plan({std::string(TESSERA_EXAMPLES_DIR) + "/llama3-8b.yaml", "--device=h100-sxm",
              "--layout=dp=64,zero=2,ac=full", "--output=json"});
  ASSERT_EQ(run.exit.exit_code, 0) << run.output;
  const nlohmann::json dp_doc = nlohmann::json::parse(run.output);
  ASSERT_GE(dp_doc["layouts"].size(), 1u);
  const auto& dp_layout = dp_doc["layouts"][0];
  EXPECT_EQ(dp_layout["dp"].get<int>(), 64);
  EXPECT_EQ(dp_layout["tp"].get<int>(), 1);
  EXPECT_TRUE(dp_layout["fits"].get<bool>());
  EXPECT_LT(dp_layout["est_tokens_per_s"].get<double>(), layout["est_tokens_per_s"].get<double>());
  // Planning is not submission: a layout the trainer does not run (ZeRO-2 next to tensor
  // parallelism) is still estimated offline.
  run = Plan({std::string(TESSERA_EXAMPLES_DIR) + "/llama3-8b.yaml", "--device=h100-sxm",
              "--layout=dp=8,tp=8,zero=2,sp=on,ac=selective", "--output=json"});
  ASSERT_EQ(run.exit.exit_code, 0) << run.output;
  const nlohmann::json tp_doc = nlohmann::json::parse(run.output);
  ASSERT_GE(tp_doc["layouts"].size(), 1u);
  const auto& tp_layout = tp_doc["layouts"][0];
  EXPECT_EQ(tp_layout["tp"].get<int>(), 8);
  EXPECT_EQ(tp_layout["dp"].get<int>(), 8);
  EXPECT_EQ(tp_layout["zero"].get<int>(), 2);
  EXPECT_TRUE(tp_layout["sp"].get<bool>());
  EXPECT_TRUE(tp_layout["fits"].get<bool>());
  // Pipeline layouts too, with a memory estimate per stage.
  run = Plan({"--model=llama3-8b", "--seq_len=4096", "--global_batch=64", "--gpus=16",
              "--device=h100-sxm", "--layout=dp=4,tp=2,pp=2,zero=1", "--output=json"});
  ASSERT_EQ(run.exit.exit_code, 0) << run.output;
  const nlohmann::json pp_doc = nlohmann::json::parse(run.output);
  ASSERT_GE(pp_doc["layouts"].size(), 1u);
  EXPECT_EQ(pp_doc["layouts"][0]["pp"].get<int>(), 2);
  EXPECT_EQ(pp_doc["layouts"][0]["memory"]["stages"].size(), 2u);
}

TEST(CliPlanTest, ContextExpertAndInterleavedTermsAreShown) {
  // An explicit context-parallel, interleaved layout: dp is what remains of 8 GPUs after
  // tp 1 x pp 2 x cp 2.
  RunResult run = Plan({"--model=qwen3-8b", "--seq_len=32768", "--global_batch=16", "--gpus=8",
                        "--device=h200", "--layout=pp=2,cp=2,v=3,ac=full", "--output=json"});
  ASSERT_EQ(run.exit.exit_code, 0) << run.output;
  const nlohmann::json doc = nlohmann::json::parse(run.output);
  ASSERT_GE(doc["layouts"].size(), 1u);
  const auto& layout = doc["layouts"][0];
  EXPECT_EQ(layout["dp"].get<int>(), 2);
  EXPECT_EQ(layout["cp"].get<int>(), 2);
  EXPECT_EQ(layout["ep"].get<int>(), 1);
  EXPECT_EQ(layout["v"].get<int>(), 3);
  EXPECT_GT(layout["memory"]["context_ring_bytes"].get<int64_t>(), 0);
  EXPECT_GT(layout["step_time"]["context_ring_s"].get<double>(), 0);
  // m = 16 / (mb x dp 2) micro-batches: the bubble is (pp-1)/(v x m).
  const double m = layout["grad_accum"].get<double>();
  EXPECT_NEAR(layout["step_time"]["pipeline_bubble_fraction"].get<double>(), 1.0 / (3 * m), 1e-9);
  // The table names the new columns and terms; an MoE preset plans with expert parallelism.
  run = Plan({"--model=qwen3-30b-a3b", "--seq_len=4096", "--global_batch=64", "--gpus=8",
              "--device=h200", "--layout=dp=8,ep=8,zero=1,ac=full"});
  ASSERT_EQ(run.exit.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr(" cp  ep  v "));
  EXPECT_THAT(run.output, HasSubstr("ep=8"));
  EXPECT_THAT(run.output, HasSubstr("routed experts' state"));
  EXPECT_THAT(run.output, HasSubstr("all-to-all buffers"));
  EXPECT_THAT(run.output, HasSubstr("expert all-to-all"));
}

TEST(CliPlanTest, DeviceFieldsCanBeOverridden) {
  RunResult run =
      Plan({"--model=gpt2-124m", "--seq_len=1024", "--global_batch=64", "--gpus=8",
            "--device=a100-80gb", "--device_override=memory_bytes=40GiB,peak_flops_bf16=200e12",
            "--output=json", "--max_candidates=1"});
  ASSERT_EQ(run.exit.exit_code, 0) << run.output;
  const nlohmann::json doc = nlohmann::json::parse(run.output);
  EXPECT_EQ(doc["cluster"]["device"]["name"].get<std::string>(), "a100-80gb");
  EXPECT_EQ(doc["cluster"]["device"]["memory_bytes"].get<int64_t>(), int64_t{40} << 30);
  EXPECT_EQ(doc["cluster"]["device"]["peak_flops_bf16"].get<double>(), 200e12);
  run = Plan({"--model=gpt2-124m", "--seq_len=1024", "--global_batch=64", "--gpus=8",
              "--device_override=foo=1"});
  EXPECT_EQ(run.exit.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("unknown field 'foo'; known: peak_flops_bf16"));
}

TEST(CliPlanTest, BadFlagsAreUsageErrors) {
  RunResult run = Plan({"--model=gpt2-124m", "--seq_len=1024", "--global_batch=8", "--gpus=8",
                        "--device=h100-sxm", "--layout=tp=2,xx=1"});
  EXPECT_EQ(run.exit.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--layout: unknown key 'xx'"));
  run = Plan({"--model=gpt2-124m", "--seq_len=1024", "--global_batch=8", "--gpus=8",
              "--gpu_memory=eighty"});
  EXPECT_EQ(run.exit.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("--gpu_memory: 'eighty' is not a size"));
  run =
      Plan({"--model=gpt9", "--seq_len=1024", "--global_batch=8", "--gpus=8", "--device=h100-sxm"});
  EXPECT_EQ(run.exit.exit_code, 1);
  EXPECT_THAT(run.output, HasSubstr("model.preset: unknown preset 'gpt9'"));
  run =
      Plan({"--model=gpt2-124m", "--seq_len=1024", "--global_batch=8", "--gpus=8", "--device=tpu"});
  EXPECT_EQ(run.exit.exit_code, 1);
  EXPECT_THAT(run.output, HasSubstr("'tpu' is not a known device"));
}

}  // namespace
}  // namespace tessera
