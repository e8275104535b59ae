// What the trainer's end-to-end tests share: real tessera-trainer processes on the bundled corpus
// (CPU, Gloo over loopback), one or several ranks, their JSON reports parsed, and the comparison
// of safetensors exports. The fixture prepares the corpus's token shards once per test suite and
// gives every trainer it starts one intra-op thread, as the worker and torchrun give ranks that
// share a node's cores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "common/trainer_env.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "planner/model_config.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/util/free_port.h"
#include "tests/util/subprocess.h"
#include "trainer/io/safetensors.h"

namespace tessera::testing {

struct TrainerRun {
  int exit_code = -1;
  std::string output;
  std::vector<v1::TrainerReport> reports;
  // step -> loss, from the metrics reports.
  std::map<int64_t, double> losses;
};

inline void ParseReports(TrainerRun& run) {
  for (absl::string_view line : absl::StrSplit(run.output, '\n')) {
    if (!absl::StartsWith(line, "{")) continue;
    v1::TrainerReport report;
    if (!google::protobuf::util::JsonStringToMessage(std::string(line), &report).ok()) continue;
    if (report.has_metrics()) run.losses[report.metrics().step()] = report.metrics().loss();
    run.reports.push_back(std::move(report));
  }
}

// The evaluations a run reported, in order.
inline std::vector<v1::EvalMetrics> Evals(const TrainerRun& run) {
  std::vector<v1::EvalMetrics> evals;
  for (const auto& report : run.reports) {
    if (report.has_eval()) evals.push_back(report.eval());
  }
  return evals;
}

class TrainerTrainingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // In the test program's environment, so that every trainer inherits it: the ranks of
    // RunRanks, the one-process references they are compared with (the same intra-op reduction
    // order) and the processes a suite starts itself. Several ranks with a thread per core each
    // oversubscribe the cores, and their OpenMP teams then spin waiting for descheduled threads
    // (measured on 2 cores: 25 s a step at cp 2 with two threads per rank, 0.2-0.5 s with one).
    setenv(kOmpNumThreadsEnv, "1", /*overwrite=*/1);
    setenv(kMklNumThreadsEnv, "1", /*overwrite=*/1);
    data_dir_ = new std::string(MakeTempDir("data"));
    auto prepared = RunCommand({Trainer(), "prepare", "--input=" + CorpusPath(),
                                "--output_dir=" + *data_dir_, "--val_fraction=0.05"});
    ASSERT_THAT(prepared, IsOk());
    ASSERT_EQ(prepared->exit.exit_code, 0) << prepared->output;
  }

  static std::string Trainer() { return BinDir() + "/tessera-trainer"; }
  static std::string CorpusPath() { return TESSERA_CORPUS_FILE; }

  static std::string MakeTempDir(const std::string& name) {
    std::string pattern = absl::StrCat(::testing::TempDir(), "tessera-", name, "-XXXXXX");
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    char* dir = mkdtemp(buffer.data());
    EXPECT_NE(dir, nullptr);
    return dir;
  }

  // One job spec setting on a trainer's command line: tessera-trainer --set PATH=VALUE.
  static std::string Set(absl::string_view path, absl::string_view value) {
    return absl::StrCat("--set=", path, "=", value);
  }
  // data.train_shards (or another list of shards, e.g. "data.validation_shards") of one glob.
  static std::string Shards(absl::string_view field, absl::string_view glob) {
    return Set(field, absl::StrCat("[\"", glob, "\"]"));
  }
  // parallelism.layout.activation_checkpointing_mode: "none", "selective" or "full".
  static std::string Recompute(absl::string_view mode) {
    return Set("parallelism.layout.activation_checkpointing_mode",
               absl::StrCat("ACTIVATION_CHECKPOINTING_", absl::AsciiStrToUpper(mode)));
  }
  // The value of the last setting of `path` in `flags`, if any.
  static std::optional<std::string> SettingOf(const std::vector<std::string>& flags,
                                              absl::string_view path) {
    const std::string prefix = absl::StrCat("--set=", path, "=");
    std::optional<std::string> value;
    for (const std::string& flag : flags) {
      if (absl::StartsWith(flag, prefix)) value = flag.substr(prefix.size());
    }
    return value;
  }
  // Replaces `flags`' model.preset with the preset's dimensions as `change` leaves them (a spec
  // names a preset or dimensions, not both), or changes the model.dims already there: e.g. fewer
  // layers, or experts in every block.
  static void ChangeModelDims(std::vector<std::string>& flags,
                              const std::function<void(v1::ModelDims&)>& change) {
    const std::string preset_flag = "--set=model.preset=", dims_flag = "--set=model.dims=";
    auto it = std::find_if(flags.begin(), flags.end(), [&](const std::string& flag) {
      return absl::StartsWith(flag, preset_flag) || absl::StartsWith(flag, dims_flag);
    });
    ASSERT_NE(it, flags.end()) << "no model.preset or model.dims to change";
    v1::ModelDims dims;
    if (absl::StartsWith(*it, dims_flag)) {
      ASSERT_TRUE(
          google::protobuf::util::JsonStringToMessage(it->substr(dims_flag.size()), &dims).ok());
    } else {
      v1::ModelSpec model;
      model.set_preset(it->substr(preset_flag.size()));
      int seq_len = 0;
      ASSERT_TRUE(absl::SimpleAtoi(SettingOf(flags, "data.seq_len").value_or("0"), &seq_len));
      auto summary = planner::ResolveModel(model, seq_len);
      ASSERT_THAT(summary, IsOk());
      dims = summary->dims();
    }
    change(dims);
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    ASSERT_TRUE(google::protobuf::util::MessageToJsonString(dims, &json, options).ok());
    *it = Set("model.dims", json);
  }

  // decay_steps pins the schedule, so a run of fewer steps follows the same
  // learning-rate curve as a longer one (stop/resume compares the two). The optimizer's weight
  // decay, clipping and schedule floor are set as the suites were tuned with. flags[1] is the
  // training data.
  static std::vector<std::string> BaseFlags(int steps, const std::string& checkpoint_dir = "",
                                            int decay_steps = 0) {
    std::vector<std::string> flags = {
        Trainer(),
        Shards("data.train_shards", *data_dir_ + "/train-*.bin"),
        Set("name", "standalone"),
        Set("model.preset", "tiny-gpt2"),
        Set("data.seq_len", "64"),
        Set("batch.global_batch_size", "8"),
        Set("batch.micro_batch_size", "2"),
        Set("optimizer.schedule.peak_learning_rate", "3e-3"),
        Set("optimizer.schedule.warmup_steps", "5"),
        Set("optimizer.schedule.min_lr_ratio", "0.1"),
        Set("optimizer.weight_decay", "0.1"),
        Set("optimizer.grad_clip_norm", "1"),
        Set("max_steps", absl::StrCat(steps)),
        Set("optimizer.schedule.decay_steps", absl::StrCat(decay_steps)),
        Set("seed", "7")};
    if (!checkpoint_dir.empty()) flags.push_back(Set("checkpoint.directory", checkpoint_dir));
    return flags;
  }

  // `flags` completed with what a spec needs and the suites leave to the world they run in:
  // resources for `world` ranks (GPUs with --gpu=N), and, for an explicit layout, the degrees
  // not set (1) and the data-parallel degree (the rest of the world; unset when it does not
  // divide, which the trainer then refuses naming it).
  // A --job_spec file or a --task says all of it itself.
  static std::vector<std::string> ForWorld(std::vector<std::string> flags, int world) {
    if (std::any_of(flags.begin(), flags.end(), [](const std::string& flag) {
          return absl::StartsWith(flag, "--job_spec=") || absl::StartsWith(flag, "--task=");
        })) {
      return flags;
    }
    const bool gpu = std::any_of(flags.begin(), flags.end(), [](const std::string& flag) {
      return absl::StartsWith(flag, "--gpu=") && flag != "--gpu=-1";
    });
    const bool has_resources = std::any_of(flags.begin(), flags.end(), [](const std::string& f) {
      return absl::StartsWith(f, "--set=resources");
    });
    if (!has_resources) {
      flags.push_back(Set(gpu ? "resources.gpus" : "resources.cpu_slots", absl::StrCat(world)));
    }
    const bool explicit_layout = std::any_of(flags.begin(), flags.end(), [](const std::string& f) {
      return absl::StartsWith(f, "--set=parallelism.layout.");
    });
    if (!explicit_layout || SettingOf(flags, "parallelism.layout.data_parallel")) return flags;
    int others = 1;
    for (const char* degree : {"tensor_parallel", "pipeline_parallel", "context_parallel"}) {
      const std::string path = absl::StrCat("parallelism.layout.", degree);
      int value = 1;
      if (const std::optional<std::string> set = SettingOf(flags, path); set.has_value()) {
        if (!absl::SimpleAtoi(*set, &value)) value = 1;
      } else if (degree != std::string("context_parallel")) {
        flags.push_back(Set(path, "1"));  // an explicit layout names them
      }
      others *= std::max(1, value);
    }
    if (world % others == 0) {
      flags.push_back(Set("parallelism.layout.data_parallel", absl::StrCat(world / others)));
    }
    return flags;
  }

  // One trainer process, as rank 0 of 1.
  static TrainerRun RunTrainer(const std::vector<std::string>& argv) {
    TrainerRun run;
    auto result = RunCommand(ForWorld(argv, 1), absl::Minutes(5));
    EXPECT_THAT(result, IsOk());
    if (!result.ok()) return run;
    run.exit_code = result->exit.exit_code;
    run.output = result->output;
    ParseReports(run);
    return run;
  }

  // `world` real processes on Gloo over loopback, each with `flags` plus its torchrun
  // environment; returns every rank's run (rank 0 reports the all-reduced loss of each step).
  static std::vector<TrainerRun> RunRanks(const std::vector<std::string>& flags, int world) {
    const absl::StatusOr<int> port = PickFreePort();
    EXPECT_THAT(port, IsOk());
    if (!port.ok()) return {};
    std::vector<Subprocess> ranks;
    const std::vector<std::string> argv = ForWorld(flags, world);
    for (int rank = 0; rank < world; ++rank) {
      auto process = Subprocess::Start(
          argv, {.merge_stdout = true,
                 .extra_env = {absl::StrCat("RANK=", rank), absl::StrCat("WORLD_SIZE=", world),
                               absl::StrCat("LOCAL_RANK=", rank),
                               absl::StrCat("LOCAL_WORLD_SIZE=", world), "MASTER_ADDR=127.0.0.1",
                               absl::StrCat("MASTER_PORT=", *port)}});
      EXPECT_THAT(process, IsOk());
      if (!process.ok()) return {};
      ranks.push_back(std::move(*process));
    }
    std::vector<TrainerRun> runs(world);
    for (int rank = 0; rank < world; ++rank) {
      auto exit = ranks[rank].Wait(absl::Minutes(5));
      EXPECT_THAT(exit, IsOk());
      if (!exit.ok()) continue;
      runs[rank].exit_code = exit->exit_code;
      runs[rank].output = ranks[rank].stderr_text();
      ParseReports(runs[rank]);
    }
    return runs;
  }

  // Runs `flags` over `world` ranks (RunRanks) into `runs` and asserts that every rank exited 0.
  static void RunRanksToSuccess(const std::vector<std::string>& flags, int world,
                                std::vector<TrainerRun>* runs) {
    *runs = RunRanks(flags, world);
    ASSERT_EQ(runs->size(), static_cast<size_t>(world));
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ((*runs)[rank].exit_code, 0) << "rank " << rank << ":\n" << (*runs)[rank].output;
    }
  }

  // Expects `run` to report steps first..last, and only those, each loss within `tolerance`
  // relative of `reference`'s at that step; the worst relative difference goes to `worst`.
  static void ExpectLossesMatch(const TrainerRun& run, const TrainerRun& reference, int64_t first,
                                int64_t last, double tolerance, double* worst = nullptr) {
    ASSERT_EQ(run.losses.size(), static_cast<size_t>(last - first + 1)) << run.output;
    double largest = 0;
    for (int64_t step = first; step <= last; ++step) {
      ASSERT_TRUE(run.losses.contains(step)) << "step " << step << "\n" << run.output;
      ASSERT_TRUE(reference.losses.contains(step)) << "reference, step " << step;
      ASSERT_TRUE(std::isfinite(run.losses.at(step))) << "step " << step;
      const double expected = reference.losses.at(step);
      const double relative = std::abs(run.losses.at(step) - expected) / expected;
      EXPECT_LE(relative, tolerance) << "step " << step;
      largest = std::max(largest, relative);
    }
    if (worst != nullptr) *worst = largest;
  }

  // Expects `resumed` (a run of `steps` steps over a checkpoint of step `saved`) to have exited
  // 0, resumed, and trained steps saved+1..steps with `straight`'s losses within `tolerance`.
  static void ExpectResumedLike(const TrainerRun& resumed, const TrainerRun& straight,
                                int64_t saved, int64_t steps, double tolerance) {
    ASSERT_EQ(straight.exit_code, 0) << straight.output;
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_THAT(resumed.output, ::testing::HasSubstr("resumed from"));
    ExpectLossesMatch(resumed, straight, saved + 1, steps, tolerance);
  }

  // The export of the checkpoint a run with `checkpoint_dir` wrote at `step`.
  static std::map<std::string, std::vector<float>> ReadStepExport(
      const std::string& checkpoint_dir, int64_t step) {
    return ReadExport(absl::StrFormat("%s/step-%08d/model.safetensors", checkpoint_dir, step));
  }

  // `run`'s evaluations against `reference`'s, for a layout whose evaluation covers the
  // reference's samples: `count` of each, the same tokens, losses within `tolerance` relative.
  static void ExpectEvalsMatch(const TrainerRun& run, const TrainerRun& reference, size_t count,
                               double tolerance) {
    const std::vector<v1::EvalMetrics> evals = Evals(run), expected = Evals(reference);
    ASSERT_EQ(evals.size(), count) << run.output;
    ASSERT_EQ(expected.size(), count) << reference.output;
    for (size_t i = 0; i < count; ++i) {
      EXPECT_EQ(evals[i].tokens(), expected[i].tokens());
      EXPECT_LE(std::abs(evals[i].loss() - expected[i].loss()) / expected[i].loss(), tolerance)
          << "evaluation " << i;
    }
  }

  // The float32 tensors of a safetensors export, by name.
  static std::map<std::string, std::vector<float>> ReadExport(const std::string& path) {
    std::map<std::string, std::vector<float>> out;
    auto header = trainer::ReadSafetensorsHeader(path);
    EXPECT_THAT(header, IsOk()) << path;
    if (!header.ok()) return out;
    std::ifstream in(path, std::ios::binary);
    for (const auto& [name, entry] : header->tensors) {
      std::vector<float>& values = out[name];
      values.resize((entry.end - entry.begin) / sizeof(float));
      in.seekg(static_cast<std::streamoff>(header->data_offset + entry.begin));
      in.read(reinterpret_cast<char*>(values.data()),
              static_cast<std::streamsize>(entry.end - entry.begin));
    }
    return out;
  }

  // Largest ||a - b|| / ||b|| (L2 over a tensor's elements) over the tensors; both must hold
  // the same tensors.
  // Per tensor, the L2 norm of the difference relative to b's. GPT-2's fused qkv bias is
  // compared without its key third: a bias on the keys shifts every score of a query by the same
  // amount, which softmax cancels, so its exact gradient is 0 and AdamW (dividing by sqrt(v))
  // moves it by up to the learning rate per step on rounding noise alone, in whichever direction
  // the noise of that run's reduction order points.
  static double MaxRelativeDifference(const std::map<std::string, std::vector<float>>& a,
                                      const std::map<std::string, std::vector<float>>& b) {
    EXPECT_EQ(a.size(), b.size());
    double worst = 0;
    for (const auto& [name, values] : a) {
      auto it = b.find(name);
      EXPECT_NE(it, b.end()) << name;
      if (it == b.end() || it->second.size() != values.size()) return 1e9;
      const bool qkv_bias = absl::EndsWith(name, "attn.qkv.bias") && values.size() % 3 == 0;
      const size_t key_begin = values.size() / 3, key_end = qkv_bias ? 2 * key_begin : key_begin;
      double difference = 0, norm = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        if (i >= key_begin && i < key_end) continue;
        const double d = static_cast<double>(values[i]) - it->second[i];
        difference += d * d;
        norm += static_cast<double>(it->second[i]) * it->second[i];
      }
      worst = std::max(worst, std::sqrt(difference / std::max(norm, 1e-30)));
    }
    return worst;
  }

  static inline std::string* data_dir_ = nullptr;
};

}  // namespace tessera::testing
