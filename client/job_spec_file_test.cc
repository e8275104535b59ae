#include "client/job_spec_file.h"

#include <map>
#include <optional>
#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::client {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(JobSpecFileTest, YamlMapsOntoTheProtoFields) {
  auto spec = ParseJobSpec(R"(
name: demo
model: {preset: tiny-gpt2}
data:
  train_shards: [/data/train-*.bin]
  seq_len: 128
batch: {global_batch_size: 16, micro_batch_size: 4}
parallelism: auto
optimizer:
  schedule: {peak_learning_rate: 3e-3, warmup_steps: 10}
precision: PRECISION_FP32
max_steps: 200
checkpoint: {interval_steps: 100, resume: false}
resources: {cpu_slots: 2}
labels: {team: "pretraining"}
)");
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->name(), "demo");
  EXPECT_EQ(spec->model().preset(), "tiny-gpt2");
  EXPECT_EQ(spec->data().train_shards(0), "/data/train-*.bin");
  EXPECT_EQ(spec->data().seq_len(), 128);
  EXPECT_EQ(spec->batch().global_batch_size(), 16);
  EXPECT_TRUE(spec->parallelism().has_auto_layout());
  EXPECT_DOUBLE_EQ(spec->optimizer().schedule().peak_learning_rate(), 3e-3);
  EXPECT_EQ(spec->precision(), v1::PRECISION_FP32);
  EXPECT_EQ(spec->max_steps(), 200);
  EXPECT_TRUE(spec->checkpoint().has_resume());
  EXPECT_FALSE(spec->checkpoint().resume());
  EXPECT_EQ(spec->labels().at("team"), "pretraining");
}

TEST(JobSpecFileTest, ExplicitLayout) {
  auto spec = ParseJobSpec(
      "parallelism: {layout: {data_parallel: 2, tensor_parallel: 4, pipeline_parallel: 1}}");
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->parallelism().layout().tensor_parallel(), 4);
}

TEST(JobSpecFileTest, MistakesAreNamed) {
  EXPECT_THAT(ParseJobSpec("name: x\nmax_stepz: 10"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_stepz")));
  EXPECT_THAT(ParseJobSpec("name: x\nmax_stepz: 10"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(line 2)")));
  EXPECT_THAT(ParseJobSpec("name: x\n\nbatch:\n  global_batch_size: lots"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("global_batch_size")));
  EXPECT_THAT(ParseJobSpec("name: x\n\nbatch:\n  global_batch_size: lots"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(line 4)")));
  EXPECT_THAT(ParseJobSpec("name: [unclosed"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job spec")));
  EXPECT_THAT(ParseJobSpec("- just\n- a list"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mapping")));
  EXPECT_THAT(LoadJobSpec("/nonexistent/spec.yaml"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/spec.yaml")));
  // A Latin-1 byte in a key: once an uncaught JSON exception that aborted the CLI (found by
  // tests/fuzz/job_spec_fuzz.cc).
  EXPECT_THAT(ParseJobSpec("name: x\nbatch: {global_ba\x95: 8}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid UTF-8")));
}

EnvLookup Environment(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const std::string& name) -> std::optional<std::string> {
    auto it = values.find(name);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

TEST(JobSpecFileTest, TheBundledExampleParsesWithItsDataDirectoryFromTheEnvironment) {
  auto spec = LoadJobSpec(TESSERA_EXAMPLE_SPEC, Environment({{"TESSERA_DATA_DIR", "/d"}}));
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->resources().cpu_slots(), 2);
  EXPECT_EQ(spec->data().train_shards(0), "/d/train-*.bin");
  EXPECT_THAT(LoadJobSpec(TESSERA_EXAMPLE_SPEC),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("${TESSERA_DATA_DIR} is not set in the environment")));
}

TEST(JobSpecFileTest, ValuesExpandVariablesWithDefaultsAndEscapes) {
  const EnvLookup env = Environment({{"ROOT", "/mnt/data"}, {"EMPTY", ""}, {"STEPS", "30"}});
  auto spec = ParseJobSpec(
      "name: run-${STEPS}\n"
      "data: {train_shards: [\"${ROOT}/a-*.bin\", \"${EMPTY:-/fallback}/b\", \"$$HOME\"]}\n"
      "max_steps: ${STEPS}\n"
      "# a comment naming ${UNSET} is left alone\n",
      env);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->name(), "run-30");
  EXPECT_EQ(spec->max_steps(), 30);
  ASSERT_EQ(spec->data().train_shards_size(), 3);
  EXPECT_EQ(spec->data().train_shards(0), "/mnt/data/a-*.bin");
  EXPECT_EQ(spec->data().train_shards(1), "/fallback/b");
  EXPECT_EQ(spec->data().train_shards(2), "$HOME");
}

TEST(JobSpecFileTest, BadVariablesNameTheVariableAndTheLine) {
  EXPECT_THAT(ParseJobSpec("name: x\nmax_steps: ${NOPE}\n", Environment({})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("${NOPE} is not set"), HasSubstr("(line 2)"))));
  EXPECT_THAT(ExpandEnvironment("${1BAD}", Environment({})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is not an environment variable name")));
  EXPECT_THAT(ExpandEnvironment("a${OPEN", Environment({})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no closing")));
  EXPECT_THAT(ExpandEnvironment("cost $5 and $", Environment({})), IsOkAndHolds("cost $5 and $"));
}

TEST(JobSpecFileTest, SettingsOverrideTheFileInOrder) {
  auto spec = ParseJobSpec(
      "name: base\nmax_steps: 10\nparallelism: auto\n"
      "optimizer: {schedule: {peak_learning_rate: 1e-3, warmup_steps: 5}}\n",
      Environment({{"ROOT", "/mnt"}}),
      {"max_steps=20", "optimizer.schedule.peak_learning_rate=3e-3",
       "data.train_shards=[\"${ROOT}/a-*.bin\", /b]", "parallelism.layout.tensor_parallel=2",
       "parallelism.layout.activation_checkpointing_mode=ACTIVATION_CHECKPOINTING_FULL",
       "lora={rank: 8, target_modules: [q_proj, v_proj]}", "checkpoint.resume=false",
       "max_steps=30", "name="});
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->max_steps(), 30);  // the last setting wins
  EXPECT_EQ(spec->name(), "");       // an empty value is the field's default
  EXPECT_DOUBLE_EQ(spec->optimizer().schedule().peak_learning_rate(), 3e-3);
  EXPECT_EQ(spec->optimizer().schedule().warmup_steps(), 5);  // the file's, untouched
  EXPECT_THAT(spec->data().train_shards(), ElementsAre("/mnt/a-*.bin", "/b"));
  // `parallelism: auto` was a value on the way: replaced by the mapping the setting needs.
  ASSERT_TRUE(spec->parallelism().has_layout());
  EXPECT_EQ(spec->parallelism().layout().tensor_parallel(), 2);
  EXPECT_EQ(spec->parallelism().layout().activation_checkpointing_mode(),
            v1::ACTIVATION_CHECKPOINTING_FULL);
  EXPECT_EQ(spec->lora().rank(), 8);
  EXPECT_THAT(spec->lora().target_modules(), ElementsAre("q_proj", "v_proj"));
  ASSERT_TRUE(spec->checkpoint().has_resume());
  EXPECT_FALSE(spec->checkpoint().resume());
  // Settings alone make a spec; `parallelism=auto` keeps its shorthand.
  auto bare = ParseJobSpec("{}", nullptr, {"model.preset=tiny-gpt2", "parallelism=auto"});
  ASSERT_THAT(bare, IsOk());
  EXPECT_EQ(bare->model().preset(), "tiny-gpt2");
  EXPECT_TRUE(bare->parallelism().has_auto_layout());
}

TEST(JobSpecFileTest, BadSettingsAreNamed) {
  EXPECT_THAT(ParseJobSpec("{}", nullptr, {"max_steps"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected PATH=VALUE")));
  EXPECT_THAT(
      ParseJobSpec("{}", nullptr, {"data..seq_len=4"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("field names joined by dots")));
  EXPECT_THAT(ParseJobSpec("{}", nullptr, {"data.seq_len=[1"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--set data.seq_len"), HasSubstr("not a YAML value"))));
  EXPECT_THAT(ParseJobSpec("{}", Environment({}), {"max_steps=${NOPE}"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--set max_steps"), HasSubstr("${NOPE} is not set"))));
  EXPECT_THAT(ParseJobSpec("{}", nullptr, {"data.seq_lenn=4"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("seq_lenn")));
  EXPECT_THAT(ParseJobSpec("{}", nullptr, {"max_steps=many"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_steps")));
}

}  // namespace
}  // namespace tessera::client
