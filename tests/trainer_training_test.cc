// Runs real tessera-trainer processes on the bundled corpus (CPU, Gloo) and
// checks the trainer's promises: the loss falls, two data-parallel processes
// follow the single-process curve, a stopped and resumed run equals an
// uninterrupted one, and corrupted inputs are refused by name.

#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/cuda.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_matchers.h"
#include "common/trainer_env.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "planner/devices.h"
#include "planner/layout_planner.h"
#include "planner/model_config.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/util/free_port.h"
#include "tests/util/subprocess.h"
#include "trainer/model/model.h"
#include "trainer/io/safetensors.h"
#include "trainer/torch_pch.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::PickFreePort;
using ::tessera::testing::RunCommand;
using ::tessera::testing::Subprocess;
using ::testing::HasSubstr;
using ::testing::Not;

struct TrainerRun {
  int exit_code = -1;
  std::string output;
  std::vector<v1::TrainerReport> reports;
  // step -> loss, from the metrics reports.
  std::map<int64_t, double> losses;
};

void ParseReports(TrainerRun& run) {
  for (absl::string_view line : absl::StrSplit(run.output, '\n')) {
    if (!absl::StartsWith(line, "{")) continue;
    v1::TrainerReport report;
    if (!google::protobuf::util::JsonStringToMessage(std::string(line), &report).ok()) continue;
    if (report.has_metrics()) run.losses[report.metrics().step()] = report.metrics().loss();
    run.reports.push_back(std::move(report));
  }
}

// The evaluations a run reported, in order.
std::vector<v1::EvalMetrics> Evals(const TrainerRun& run) {
  std::vector<v1::EvalMetrics> evals;
  for (const auto& report : run.reports) {
    if (report.has_eval()) evals.push_back(report.eval());
  }
  return evals;
}

class TrainerTrainingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
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

  // decay_steps pins the schedule, so a run of fewer steps follows the same
  // learning-rate curve as a longer one (stop/resume compares the two).
  static std::vector<std::string> BaseFlags(int steps, const std::string& checkpoint_dir = "",
                                            int decay_steps = 0) {
    std::vector<std::string> flags = {Trainer(),
                                      "--data=" + *data_dir_ + "/train-*.bin",
                                      "--preset=tiny-gpt2",
                                      "--seq_len=64",
                                      "--global_batch=8",
                                      "--micro_batch=2",
                                      "--lr=3e-3",
                                      "--warmup=5",
                                      absl::StrCat("--steps=", steps),
                                      absl::StrCat("--decay_steps=", decay_steps),
                                      "--seed=7"};
    if (!checkpoint_dir.empty()) flags.push_back("--checkpoint_dir=" + checkpoint_dir);
    return flags;
  }

  static TrainerRun RunTrainer(const std::vector<std::string>& argv) {
    TrainerRun run;
    auto result = RunCommand(argv, absl::Minutes(5));
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
    for (int rank = 0; rank < world; ++rank) {
      auto process = Subprocess::Start(
          flags, {.merge_stdout = true,
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

  static std::string* data_dir_;
};

std::string* TrainerTrainingTest::data_dir_ = nullptr;

TEST_F(TrainerTrainingTest, LossFallsWellBelowUniform) {
  TrainerRun run = RunTrainer(BaseFlags(300));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(run.losses.size(), 300u);
  // 257 byte-level tokens: a uniform guess costs ln(257) = 5.55 nats.
  EXPECT_NEAR(run.losses.at(1), std::log(257.0), 0.5);
  double tail = 0;
  for (int64_t step = 291; step <= 300; ++step) tail += run.losses.at(step) / 10;
  EXPECT_LT(tail, 2.6) << "mean loss of the last 10 steps";
  bool finished = false;
  for (const auto& report : run.reports) finished |= report.has_finished();
  EXPECT_TRUE(finished);
}

TEST_F(TrainerTrainingTest, TwoDataParallelProcessesMatchOneProcess) {
  const int steps = 12;
  std::string single_dir = MakeTempDir("ckpt-single"), dp_dir = MakeTempDir("ckpt-dp");
  TrainerRun single = RunTrainer(BaseFlags(steps, single_dir));
  ASSERT_EQ(single.exit_code, 0) << single.output;

  // Two real processes, Gloo over loopback, global batch unchanged.
  std::vector<TrainerRun> runs = RunRanks(BaseFlags(steps, dp_dir), 2);
  ASSERT_EQ(runs.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  // Rank 0 reports the all-reduced loss of each step.
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(steps));
  double max_difference = 0;
  for (int64_t step = 1; step <= steps; ++step) {
    // Same samples, same math; only the order of float32 additions differs
    // (per-rank means, then the all-reduce; bucketed gradient sums), which
    // moves the 6th-7th significant digit and compounds a little over steps.
    EXPECT_NEAR(runs[0].losses.at(step), single.losses.at(step), 1e-4) << "step " << step;
    max_difference =
        std::max(max_difference, std::abs(runs[0].losses.at(step) - single.losses.at(step)));
  }
  RecordProperty("max_loss_difference", std::to_string(max_difference));
  std::cout << "dp=2 vs dp=1: max |loss difference| over " << steps << " steps = " << max_difference
            << "\n";
}

TEST_F(TrainerTrainingTest, StopAndResumeEqualsAnUninterruptedRun) {
  const int n = 10;
  TrainerRun straight = RunTrainer(BaseFlags(2 * n, "", 2 * n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  // Train n steps (checkpoint at the end), stop, then train on to 2n.
  std::string dir = MakeTempDir("ckpt-resume");
  TrainerRun first = RunTrainer(BaseFlags(n, dir, 2 * n));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  for (int64_t step = 1; step <= n; ++step) {
    EXPECT_NEAR(first.losses.at(step), straight.losses.at(step), 1e-5) << "step " << step;
  }
  TrainerRun resumed = RunTrainer(BaseFlags(2 * n, dir, 2 * n));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from"));
  ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(n));
  for (int64_t step = n + 1; step <= 2 * n; ++step) {
    EXPECT_NEAR(resumed.losses.at(step), straight.losses.at(step), 1e-5) << "step " << step;
  }
}

// Checkpoints are written in the background (AsyncCheckpointer). A process killed (SIGKILL)
// while step 6's shard is half written leaves a staging directory that resume never reads: the
// rerun resumes from step 4 and trains on exactly as an uninterrupted run.
TEST_F(TrainerTrainingTest, AnAsyncSaveKilledMidWriteIsNeverResumedFrom) {
  const int n = 8;
  TrainerRun straight = RunTrainer(BaseFlags(n, "", n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string dir = MakeTempDir("ckpt-killed");
  std::vector<std::string> flags = BaseFlags(n, dir, n);
  flags.push_back("--checkpoint_every=2");
  std::vector<std::string> killed = {"/usr/bin/env",
                                     absl::StrCat(kFaultKillInCheckpointAtStepEnv, "=6")};
  killed.insert(killed.end(), flags.begin(), flags.end());
  TrainerRun first = RunTrainer(killed);
  EXPECT_NE(first.exit_code, 0) << first.output;
  EXPECT_TRUE(fs::exists(dir + "/step-00000004/manifest.pb"));
  EXPECT_FALSE(fs::exists(dir + "/step-00000006"));
  TrainerRun resumed = RunTrainer(flags);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + dir + "/step-00000004"));
  for (int64_t step = 5; step <= n; ++step) {
    EXPECT_NEAR(resumed.losses.at(step), straight.losses.at(step), 1e-5) << "step " << step;
  }
  // Every step after a save reports how long the save blocked training.
  bool reported = false;
  for (const auto& report : resumed.reports) {
    reported |= report.has_metrics() && report.metrics().step() == 7 &&
                report.metrics().checkpoint_blocked_seconds() > 0;
  }
  EXPECT_TRUE(reported) << resumed.output;
}

TEST_F(TrainerTrainingTest, TruncatedShardIsRefusedByName) {
  std::string dir = MakeTempDir("bad-data");
  std::string shard = dir + "/train-00000.bin";
  fs::copy_file(*data_dir_ + "/train-00000.bin", shard);
  fs::resize_file(shard, fs::file_size(shard) - 1000);
  std::vector<std::string> flags = BaseFlags(5);
  flags[1] = "--data=" + shard;
  TrainerRun run = RunTrainer(flags);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr(shard));
  EXPECT_THAT(run.output, HasSubstr("truncated"));
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_DATA_ERROR;
  }
  EXPECT_TRUE(typed) << "no DATA_ERROR failure report in:\n" << run.output;
}

// A shard whose header is fine but whose body holds ids beyond its vocabulary fails the run as
// DATA_ERROR naming the file, instead of indexing past the embedding.
TEST_F(TrainerTrainingTest, TokensBeyondTheVocabularyAreADataError) {
  std::string dir = MakeTempDir("bad-tokens");
  std::string shard = dir + "/train-00000.bin";
  fs::copy_file(*data_dir_ + "/train-00000.bin", shard);
  {
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(4096);
    const std::string ones(fs::file_size(shard) - 4096, '\xff');
    file.write(ones.data(), static_cast<std::streamsize>(ones.size()));
  }
  std::vector<std::string> flags = BaseFlags(5);
  flags[1] = "--data=" + shard;
  TrainerRun run = RunTrainer(flags);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr(shard + ": token "));
  EXPECT_THAT(run.output, HasSubstr("not below the vocabulary size 257"));
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_DATA_ERROR;
  }
  EXPECT_TRUE(typed) << "no DATA_ERROR failure report in:\n" << run.output;
}

TEST_F(TrainerTrainingTest, EvaluatesOnHeldOutShards) {
  std::vector<std::string> flags = BaseFlags(60);
  flags.push_back("--val_data=" + *data_dir_ + "/val-*.bin");
  flags.push_back("--eval_every=20");
  flags.push_back("--eval_batches=4");
  TrainerRun run = RunTrainer(flags);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::vector<v1::EvalMetrics> evals;
  for (const auto& report : run.reports) {
    if (report.has_eval()) evals.push_back(report.eval());
  }
  ASSERT_EQ(evals.size(), 3u) << run.output;
  EXPECT_EQ(evals[0].step(), 20);
  EXPECT_EQ(evals[2].step(), 60);
  for (const auto& eval : evals) {
    EXPECT_NEAR(eval.perplexity(), std::exp(eval.loss()), 1e-9 * eval.perplexity());
    // 4 micro-batches x 2 sequences x 64 tokens.
    EXPECT_EQ(eval.tokens(), 4 * 2 * 64);
  }
  EXPECT_LT(evals[2].loss(), evals[0].loss()) << "held-out loss should fall with training";
}

TEST_F(TrainerTrainingTest, DivergenceIsReportedAsNanLoss) {
  // A learning rate of 1e4 without clipping blows the weights up within steps.
  std::vector<std::string> flags = BaseFlags(20);
  flags.push_back("--lr=1e4");
  flags.push_back("--warmup=0");
  flags.push_back("--grad_clip=0");
  TrainerRun run = RunTrainer(flags);
  EXPECT_EQ(run.exit_code, 1);
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_NAN_LOSS;
  }
  EXPECT_TRUE(typed) << "no NAN_LOSS failure report in:\n" << run.output;
  EXPECT_LT(run.losses.size(), 20u);
}

// Flips one byte of a checkpoint's shard file (a digest mismatch, the size unchanged).
void FlipByte(const std::string& path, std::streamoff offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(file.is_open()) << path;
  file.seekg(offset);
  char byte = 0;
  file.read(&byte, 1);
  file.seekp(offset);
  byte = static_cast<char>(~byte);
  file.write(&byte, 1);
}

// A resume verifies the digests while it loads: the corrupted newest checkpoint is loaded,
// found out, set aside as .corrupt and the older one loaded in its place, in the same process.
TEST_F(TrainerTrainingTest, CorruptedCheckpointIsSkippedByName) {
  std::string dir = MakeTempDir("ckpt-corrupt");
  std::vector<std::string> flags = BaseFlags(4, dir);
  flags.push_back("--checkpoint_every=2");
  TrainerRun first = RunTrainer(flags);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Flip a byte in the newest checkpoint's shard.
  std::string shard = dir + "/step-00000004/rank-00000.safetensors";
  FlipByte(shard, 100);
  flags = BaseFlags(6, dir);
  TrainerRun resumed = RunTrainer(flags);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr(shard));
  EXPECT_THAT(resumed.output, HasSubstr("xxh3-128 mismatch"));
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + dir + "/step-00000002"));
  EXPECT_EQ(resumed.losses.begin()->first, 3) << "should resume after step 2";
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/step-00000004.corrupt"))
      << "the corrupted checkpoint is kept aside for inspection";
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-00000004"));

  // The losses after the fallback are those of a run that resumed from step 2 untouched: nothing
  // of the corrupted checkpoint's load survives the second one.
  std::string clean = MakeTempDir("ckpt-corrupt-reference");
  flags = BaseFlags(4, clean);
  flags.push_back("--checkpoint_every=2");
  ASSERT_EQ(RunTrainer(flags).exit_code, 0);
  std::filesystem::remove_all(clean + "/step-00000004");
  TrainerRun reference = RunTrainer(BaseFlags(6, clean));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  EXPECT_EQ(resumed.losses, reference.losses);
}

// Under dp=2 each rank hashes the shard it reads; the mismatch found by rank 1 alone sends both
// ranks back to the older checkpoint.
TEST_F(TrainerTrainingTest, ACorruptedShardOfAnotherRankSendsEveryRankToTheOlderCheckpoint) {
  std::string dir = MakeTempDir("ckpt-corrupt-dp");
  std::vector<std::string> flags = BaseFlags(4, dir);
  flags.push_back("--checkpoint_every=2");
  for (const TrainerRun& run : RunRanks(flags, 2)) ASSERT_EQ(run.exit_code, 0) << run.output;
  FlipByte(dir + "/step-00000004/rank-00001.safetensors", 200);
  std::vector<TrainerRun> resumed = RunRanks(BaseFlags(6, dir), 2);
  ASSERT_EQ(resumed.size(), 2u);
  for (const TrainerRun& run : resumed) {
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_THAT(run.output, HasSubstr("resumed from " + dir + "/step-00000002"));
  }
  EXPECT_THAT(resumed[0].output, HasSubstr("rank-00001.safetensors: xxh3-128 mismatch"));
  EXPECT_EQ(resumed[0].losses.begin()->first, 3);
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/step-00000004.corrupt"));
}

// When the only checkpoint turns out corrupted after it was loaded, the attempt fails as a
// checkpoint error naming it (its state is no longer the initial one); the next attempt, with the
// checkpoint set aside, starts from step 1.
TEST_F(TrainerTrainingTest, AnOnlyCheckpointFoundCorruptWhileLoadingFailsTheAttemptAndIsSetAside) {
  std::string dir = MakeTempDir("ckpt-corrupt-only");
  std::vector<std::string> flags = BaseFlags(2, dir);
  flags.push_back("--checkpoint_every=2");
  ASSERT_EQ(RunTrainer(flags).exit_code, 0);
  FlipByte(dir + "/step-00000002/rank-00000.safetensors", 300);
  TrainerRun failed = RunTrainer(BaseFlags(4, dir));
  EXPECT_NE(failed.exit_code, 0) << failed.output;
  EXPECT_THAT(failed.output, HasSubstr("FAILURE_KIND_CHECKPOINT_ERROR"));
  EXPECT_THAT(failed.output, HasSubstr("set aside as " + dir + "/step-00000002.corrupt"));
  EXPECT_TRUE(failed.losses.empty());
  TrainerRun restarted = RunTrainer(BaseFlags(4, dir));
  ASSERT_EQ(restarted.exit_code, 0) << restarted.output;
  EXPECT_EQ(restarted.losses.begin()->first, 1);
  EXPECT_THAT(restarted.output, ::testing::Not(HasSubstr("resumed from")));
}

// ZeRO stage x activation checkpointing on dp ranks against one process without either: the same
// global batch, so every step's loss agrees to float32 reduction-order noise and so do the final
// weights (exported and gathered from the shards by the safetensors export).
struct ShardedCase {
  int dp;
  int zero;
  std::string recompute;
};

std::string CaseName(const ::testing::TestParamInfo<ShardedCase>& info) {
  return absl::StrCat("dp", info.param.dp, "_zero", info.param.zero, "_", info.param.recompute);
}

class ShardedTrainingTest : public TrainerTrainingTest,
                            public ::testing::WithParamInterface<ShardedCase> {
 protected:
  static constexpr int kSteps = 20;

  static std::vector<std::string> Flags(const std::string& dir, int zero,
                                        const std::string& recompute) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    flags.push_back(absl::StrCat("--zero_stage=", zero));
    flags.push_back("--activation_checkpointing=" + recompute);
    flags.push_back("--export_safetensors");
    return flags;
  }

  // The dp=1 run without ZeRO or recomputation, once for the suite.
  static const TrainerRun& Reference() {
    static TrainerRun* run = [] {
      auto* reference = new TrainerRun;
      *reference_dir_ = MakeTempDir("ckpt-reference");
      *reference = RunTrainer(Flags(*reference_dir_, 0, "none"));
      return reference;
    }();
    return *run;
  }
  static std::string* reference_dir_;
};

std::string* ShardedTrainingTest::reference_dir_ = new std::string;

TEST_P(ShardedTrainingTest, LossesAndWeightsMatchOneProcess) {
  const ShardedCase& c = GetParam();
  const TrainerRun& reference = Reference();
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string dir = MakeTempDir("ckpt-sharded");
  std::vector<TrainerRun> runs = RunRanks(Flags(dir, c.zero, c.recompute), c.dp);
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.dp));
  for (int rank = 0; rank < c.dp; ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  EXPECT_THAT(runs[0].output, HasSubstr(absl::StrCat("ZeRO ", c.zero)));
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(kSteps));
  double worst = 0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const double expected = reference.losses.at(step);
    const double relative = std::abs(runs[0].losses.at(step) - expected) / expected;
    EXPECT_LE(relative, 1e-5) << "step " << step;
    worst = std::max(worst, relative);
  }
  const std::string export_path =
      absl::StrCat("/step-", std::string(6, '0'), kSteps, "/model.safetensors");
  const double weights = MaxRelativeDifference(ReadExport(dir + export_path),
                                               ReadExport(*reference_dir_ + export_path));
  std::cout << CaseName({GetParam(), 0}) << ": max relative loss difference " << worst
            << ", max relative weight difference " << weights << "\n";
  // Per tensor, in L2 (the key bias aside, see MaxRelativeDifference): 2-3e-7 measured.
  EXPECT_LE(weights, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    ZeroByRecompute, ShardedTrainingTest,
    ::testing::Values(ShardedCase{2, 0, "none"}, ShardedCase{2, 0, "selective"},
                      ShardedCase{2, 0, "full"}, ShardedCase{2, 1, "none"},
                      ShardedCase{2, 1, "selective"}, ShardedCase{2, 1, "full"},
                      ShardedCase{2, 2, "none"}, ShardedCase{2, 2, "selective"},
                      ShardedCase{2, 2, "full"}, ShardedCase{2, 3, "none"},
                      ShardedCase{2, 3, "selective"}, ShardedCase{2, 3, "full"},
                      ShardedCase{4, 3, "none"}, ShardedCase{4, 3, "selective"},
                      ShardedCase{4, 3, "full"}, ShardedCase{1, 3, "full"}),
    CaseName);

// Tensor (with and without sequence parallelism) and 1F1B pipeline parallelism, alone and with
// data parallelism and ZeRO-1, against one process of the same model: the same global batch, so
// the 20 losses agree to float32 reduction-order noise and so do the final weights, exported from
// the tensor-parallel and pipeline shards of the checkpoint.
struct ModelParallelCase {
  std::string name;
  int world;
  int tp;
  int pp;
  bool sp;
  int zero;
  std::string recompute;
  std::string preset;
  int layers;  // 0: the preset's
};

class ModelParallelTest : public TrainerTrainingTest,
                          public ::testing::WithParamInterface<ModelParallelCase> {
 protected:
  static constexpr int kSteps = 20;

  static std::vector<std::string> ModelFlags(const std::string& dir, const std::string& preset,
                                             int layers) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    for (auto& flag : flags) {
      if (flag == "--preset=tiny-gpt2") flag = "--preset=" + preset;
    }
    if (layers > 0) flags.push_back(absl::StrCat("--num_layers=", layers));
    flags.push_back("--export_safetensors");
    flags.push_back("--val_data=" + *data_dir_ + "/val-*.bin");
    flags.push_back("--eval_every=10");
    flags.push_back("--eval_batches=3");
    return flags;
  }

  // One process of the case's model, once per model for the suite; returns its checkpoint dir.
  static const TrainerRun& Reference(const std::string& preset, int layers, std::string* dir) {
    static auto* runs = new std::map<std::string, std::pair<std::string, TrainerRun>>;
    const std::string key = absl::StrCat(preset, "/", layers);
    auto it = runs->find(key);
    if (it == runs->end()) {
      const std::string reference_dir = MakeTempDir("ckpt-mp-reference");
      it = runs->emplace(key, std::make_pair(reference_dir,
                                             RunTrainer(ModelFlags(reference_dir, preset, layers))))
               .first;
    }
    *dir = it->second.first;
    return it->second.second;
  }
};

TEST_P(ModelParallelTest, LossesAndWeightsMatchOneProcess) {
  const ModelParallelCase& c = GetParam();
  std::string reference_dir;
  const TrainerRun& reference = Reference(c.preset, c.layers, &reference_dir);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string dir = MakeTempDir("ckpt-mp");
  std::vector<std::string> flags = ModelFlags(dir, c.preset, c.layers);
  flags.push_back(absl::StrCat("--tensor_parallel=", c.tp));
  flags.push_back(absl::StrCat("--pipeline_parallel=", c.pp));
  if (c.sp) flags.push_back("--sequence_parallel");
  flags.push_back(absl::StrCat("--zero_stage=", c.zero));
  flags.push_back("--activation_checkpointing=" + c.recompute);
  std::vector<TrainerRun> runs = RunRanks(flags, c.world);
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.world));
  for (int rank = 0; rank < c.world; ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  EXPECT_THAT(runs[0].output, HasSubstr(absl::StrCat("dp 0/", c.world / (c.tp * c.pp), ", tp 0/",
                                                     c.tp, ", pp 0/", c.pp)));
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(kSteps)) << runs[0].output;
  double worst = 0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const double expected = reference.losses.at(step);
    const double relative = std::abs(runs[0].losses.at(step) - expected) / expected;
    EXPECT_LE(relative, 1e-5) << "step " << step;
    worst = std::max(worst, relative);
  }
  // Evaluation runs through the stages too, each sample counted once (eval_batches are per dp
  // rank, so only dp 1 evaluates the reference's samples).
  const std::vector<v1::EvalMetrics> evals = Evals(runs[0]), expected_evals = Evals(reference);
  ASSERT_EQ(evals.size(), 2u) << runs[0].output;
  ASSERT_EQ(expected_evals.size(), 2u);
  for (size_t i = 0; i < evals.size() && c.world == c.tp * c.pp; ++i) {
    EXPECT_EQ(evals[i].tokens(), expected_evals[i].tokens());
    EXPECT_LE(std::abs(evals[i].loss() - expected_evals[i].loss()) / expected_evals[i].loss(),
              1e-5);
  }
  const std::string export_path =
      absl::StrCat("/step-", std::string(6, '0'), kSteps, "/model.safetensors");
  const auto exported = ReadExport(dir + export_path);
  const auto expected = ReadExport(reference_dir + export_path);
  ASSERT_EQ(exported.size(), expected.size());
  const double weights = MaxRelativeDifference(exported, expected);
  std::cout << c.name << ": max relative loss difference " << worst
            << ", max relative weight difference " << weights << "\n";
  // Tensor parallelism splits the products' sums (2e-6 measured); the key bias aside.
  EXPECT_LE(weights, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ModelParallelTest,
    ::testing::Values(
        ModelParallelCase{"tp2", 2, 2, 1, false, 0, "none", "tiny-gpt2", 0},
        ModelParallelCase{"tp2_sp", 2, 2, 1, true, 0, "none", "tiny-gpt2", 0},
        ModelParallelCase{"pp2", 2, 1, 2, false, 0, "none", "tiny-gpt2", 0},
        ModelParallelCase{"pp4", 4, 1, 4, false, 0, "none", "tiny-gpt2", 4},
        ModelParallelCase{"tp2_pp2_sp_full", 4, 2, 2, true, 0, "full", "tiny-gpt2", 0},
        ModelParallelCase{"dp2_tp2_zero1", 4, 2, 1, false, 1, "none", "tiny-llama", 0},
        ModelParallelCase{"dp2_pp2_zero1_selective", 4, 1, 2, false, 1, "selective", "tiny-gpt2",
                          0},
        ModelParallelCase{"llama_tp2_sp_selective", 2, 2, 1, true, 0, "selective", "tiny-llama", 0},
        ModelParallelCase{"llama_pp2", 2, 1, 2, false, 0, "none", "tiny-llama", 0}),
    [](const ::testing::TestParamInfo<ModelParallelCase>& info) { return info.param.name; });

// Instruction data with prompt masking (prepare --sample_seq_len): every layout that splits
// the global batch or the model (dp, tp's vocab-parallel loss, pp's last stage, and evaluation
// through them) gives one process's losses. The records' responses differ in length, so
// micro-batches and ranks hold different numbers of counted targets: a mean of per-rank means
// would differ from the global mean. Packed documents (prepare --pack, several per sample) add the
// records' positions, which every stage and rank must apply: without them on pp's second stage
// the losses differ from one process's by up to 1.6e-4.
struct MaskedLayoutCase {
  std::string name;
  int dp;
  int tp;
  int pp;
  // prepare --pack: several records per sample, kept apart by their positions.
  bool packed = false;
  bool sequence_parallel = false;
};

class MaskedTrainingTest : public TrainerTrainingTest,
                           public ::testing::WithParamInterface<MaskedLayoutCase> {
 protected:
  static constexpr int kSteps = 12;

  static const std::string& SftDir(bool packed) {
    static const std::string* dirs[2] = {nullptr, nullptr};
    const std::string*& dir = dirs[packed ? 1 : 0];
    if (dir == nullptr) {
      auto* out = new std::string(MakeTempDir(packed ? "sft-packed" : "sft"));
      const std::string jsonl = *out + "/chat.jsonl";
      std::ofstream file(jsonl);
      for (int i = 0; i < 240; ++i) {
        std::string reply;
        for (int j = 0; j < 1 + (i * 7) % 30; ++j) reply += static_cast<char>('a' + (i + j) % 26);
        if (packed) {
          // Documents of 4 to 19 tokens with their eos: three or more share a 65-token sample.
          file << "{\"text\": \"" << reply.substr(0, 3 + i % 16) << "\"}\n";
          continue;
        }
        file << "{\"messages\": [{\"role\": \"user\", \"content\": \"echo " << i % 17
             << "\"}, {\"role\": \"assistant\", \"content\": \"" << reply << "\"}]}\n";
      }
      file.close();
      std::vector<std::string> args = {Trainer(),
                                       "prepare",
                                       "--input=" + jsonl,
                                       "--output_dir=" + *out,
                                       "--sample_seq_len=64",
                                       "--val_fraction=0.1"};
      if (packed) args.push_back("--pack");
      auto prepared = RunCommand(args);
      EXPECT_THAT(prepared, IsOk());
      if (prepared.ok()) {
        EXPECT_EQ(prepared->exit.exit_code, 0) << prepared->output;
        EXPECT_THAT(prepared->output, HasSubstr("with a loss mask"));
        if (packed) {
          EXPECT_THAT(prepared->output, HasSubstr("records packed into samples"));
        }
      }
      dir = out;
    }
    return *dir;
  }

  static std::vector<std::string> MaskedFlags(const std::string& checkpoint_dir, bool packed) {
    std::vector<std::string> flags = BaseFlags(kSteps, checkpoint_dir);
    for (auto& flag : flags) {
      if (flag.starts_with("--data=")) flag = "--data=" + SftDir(packed) + "/train-*.bin";
    }
    flags.push_back("--val_data=" + SftDir(packed) + "/val-*.bin");
    flags.push_back("--eval_every=6");
    flags.push_back("--eval_batches=3");
    return flags;
  }

  static const TrainerRun& Reference(bool packed) {
    static const TrainerRun* runs[2] = {nullptr, nullptr};
    const TrainerRun*& run = runs[packed ? 1 : 0];
    if (run == nullptr) {
      run = new TrainerRun(RunTrainer(MaskedFlags(MakeTempDir("sft-ref"), packed)));
    }
    return *run;
  }
};

TEST_P(MaskedTrainingTest, LossesAndEvaluationMatchOneProcess) {
  const MaskedLayoutCase& c = GetParam();
  const TrainerRun& reference = Reference(c.packed);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps)) << reference.output;
  const std::vector<v1::EvalMetrics> expected_evals = Evals(reference);
  ASSERT_EQ(expected_evals.size(), 2u) << reference.output;
  // Only response tokens count: fewer than the 3 x 2 x 64 targets of the evaluated samples.
  EXPECT_GT(expected_evals[0].tokens(), 0);
  EXPECT_LT(expected_evals[0].tokens(), 3 * 2 * 64);

  std::vector<std::string> flags = MaskedFlags(MakeTempDir("sft-" + c.name), c.packed);
  flags.push_back(absl::StrCat("--tensor_parallel=", c.tp));
  flags.push_back(absl::StrCat("--pipeline_parallel=", c.pp));
  if (c.sequence_parallel) flags.push_back("--sequence_parallel");
  const int world = c.dp * c.tp * c.pp;
  std::vector<TrainerRun> runs = RunRanks(flags, world);
  ASSERT_EQ(runs.size(), static_cast<size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(kSteps)) << runs[0].output;
  double worst = 0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const double expected = reference.losses.at(step);
    ASSERT_TRUE(std::isfinite(runs[0].losses.at(step))) << "step " << step;
    const double relative = std::abs(runs[0].losses.at(step) - expected) / expected;
    EXPECT_LE(relative, 2e-5) << "step " << step;
    worst = std::max(worst, relative);
  }
  std::cout << "masked " << c.name << ": max relative loss difference " << worst << "\n";
  // Evaluation takes eval_batches per dp rank: only dp 1 evaluates the reference's samples.
  const std::vector<v1::EvalMetrics> evals = Evals(runs[0]);
  ASSERT_EQ(evals.size(), 2u) << runs[0].output;
  for (size_t i = 0; i < evals.size() && c.dp == 1; ++i) {
    EXPECT_EQ(evals[i].tokens(), expected_evals[i].tokens());
    EXPECT_LE(std::abs(evals[i].loss() - expected_evals[i].loss()) / expected_evals[i].loss(),
              2e-5);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, MaskedTrainingTest,
                         ::testing::Values(MaskedLayoutCase{"dp2", 2, 1, 1},
                                           MaskedLayoutCase{"tp2", 1, 2, 1},
                                           MaskedLayoutCase{"pp2", 1, 1, 2},
                                           MaskedLayoutCase{"packed_dp2", 2, 1, 1, true},
                                           MaskedLayoutCase{"packed_tp2_sp", 1, 2, 1, true, true},
                                           MaskedLayoutCase{"packed_pp2", 1, 1, 2, true}),
                         [](const ::testing::TestParamInfo<MaskedLayoutCase>& info) {
                           return info.param.name;
                         });

// A pipeline stage that dies mid-step: its peer fails within seconds naming the lost stage's
// rank, with a typed failure, instead of waiting forever.
TEST_F(TrainerTrainingTest, DeadPipelineStageFailsItsPeerNamingTheRank) {
  std::vector<std::string> flags = BaseFlags(100000);
  flags.push_back("--pipeline_parallel=2");
  const absl::StatusOr<int> port = PickFreePort();
  ASSERT_THAT(port, IsOk());
  std::vector<Subprocess> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    auto process = Subprocess::Start(
        flags, {.merge_stdout = true,
                .extra_env = {absl::StrCat("RANK=", rank), "WORLD_SIZE=2",
                              absl::StrCat("LOCAL_RANK=", rank), "LOCAL_WORLD_SIZE=2",
                              "MASTER_ADDR=127.0.0.1", absl::StrCat("MASTER_PORT=", *port)}});
    ASSERT_THAT(process, IsOk());
    ranks.push_back(std::move(*process));
  }
  ASSERT_THAT(ranks[0].WaitForStderrLine("\"step\":\"3\"", absl::Seconds(120)), IsOk())
      << ranks[0].stderr_text();
  auto killed = ranks[1].Stop(SIGKILL);
  ASSERT_THAT(killed, IsOk());
  const absl::Time start = absl::Now();
  auto exit = ranks[0].Wait(absl::Seconds(60));
  ASSERT_THAT(exit, IsOk()) << "rank 0 did not notice its lost peer:\n" << ranks[0].stderr_text();
  EXPECT_NE(exit->exit_code, 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(40));
  TrainerRun run;
  run.output = ranks[0].stderr_text();
  ParseReports(run);
  // Named by the pipeline's send/receive, or by the check-in after another collective failed.
  EXPECT_THAT(run.output,
              ::testing::ContainsRegex("stage 1 \\(rank 1\\)|rank\\(s\\) 1 did not answer"))
      << run.output;
  // A closed connection is a consequence of rank 1's death (PEER_FAILED); only a peer that
  // stalls rather than dies would surface as a timeout.
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() &&
             (report.failure().kind() == v1::FAILURE_KIND_PEER_FAILED ||
              report.failure().kind() == v1::FAILURE_KIND_COLLECTIVE_TIMEOUT) &&
             // "stage 1 (rank 1)" from the pipeline, "rank(s) 1 did not answer" from the check-in.
             (absl::StrContains(report.failure().message(), "rank 1") ||
              absl::StrContains(report.failure().message(), "rank(s) 1")) &&
             report.failure().time().seconds() > 0;
  }
  EXPECT_TRUE(typed) << run.output;
}

// GPU: the layout code at degree 1 on NCCL (a world of one, bf16 autocast): the partitioned model
// (tp 1, pp 1: one stage holding everything) steps and its losses follow the CPU float32 run of
// the same model and samples within bf16 tolerance. Part of the GPU checks; skipped without CUDA.
TEST_F(TrainerTrainingTest, GpuDegreeOneLayoutMatchesTheCpuRunInBf16) {
  if (!::torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  constexpr int kSteps = 10;
  std::vector<std::string> flags = BaseFlags(kSteps);
  for (auto& flag : flags) {
    if (flag == "--preset=tiny-gpt2") flag = "--preset=tiny-llama";
  }
  flags.push_back("--tensor_parallel=1");
  flags.push_back("--pipeline_parallel=1");
  flags.push_back("--zero_stage=1");
  TrainerRun cpu = RunTrainer(flags);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  flags.push_back("--gpu=0");
  std::vector<TrainerRun> gpu = RunRanks(flags, 1);
  ASSERT_EQ(gpu.size(), 1u);
  ASSERT_EQ(gpu[0].exit_code, 0) << gpu[0].output;
  EXPECT_THAT(gpu[0].output, HasSubstr("nccl"));
  ASSERT_EQ(gpu[0].losses.size(), static_cast<size_t>(kSteps));
  for (int64_t step = 1; step <= kSteps; ++step) {
    const double expected = cpu.losses.at(step);
    // bf16 keeps 8 bits of mantissa: a loss near 5 moves by a few hundredths.
    EXPECT_LE(std::abs(gpu[0].losses.at(step) - expected) / expected, 2e-2) << "step " << step;
  }
}

// --cuda_graphs on a GPU: after the warm-up the micro-batches replay a captured graph (the log
// says so, after its first replay matched an eager run), and every step's loss is the eager
// run's (to 2e-3 relative). GPT-2 (LayerNorm, fused qkv, GELU) and Llama (RMSNorm, rotary, SwiGLU)
// blocks, 4 micro-batches per step, so replays accumulate gradients.
TEST_F(TrainerTrainingTest, GpuCudaGraphsReplayTheEagerSteps) {
  if (!::torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  constexpr int kSteps = 8;
  for (const std::string preset : {"tiny-gpt2", "tiny-llama"}) {
    SCOPED_TRACE(preset);
    std::vector<std::string> flags = BaseFlags(kSteps);
    for (auto& flag : flags) {
      if (flag == "--preset=tiny-gpt2") flag = "--preset=" + preset;
    }
    flags.push_back("--gpu=0");
    std::vector<TrainerRun> eager = RunRanks(flags, 1);
    flags.push_back("--cuda_graphs");
    std::vector<TrainerRun> graphs = RunRanks(flags, 1);
    ASSERT_EQ(eager.size(), 1u);
    ASSERT_EQ(graphs.size(), 1u);
    ASSERT_EQ(eager[0].exit_code, 0) << eager[0].output;
    ASSERT_EQ(graphs[0].exit_code, 0) << graphs[0].output;
    EXPECT_THAT(graphs[0].output, HasSubstr("CUDA graphs: replaying")) << graphs[0].output;
    ASSERT_EQ(graphs[0].losses.size(), static_cast<size_t>(kSteps));
    // The same kernels in the same order; what may differ is the attention backward's atomic
    // accumulation, which is not bitwise reproducible between two eager runs either. A graph
    // that dropped or doubled a gradient would move the losses by far more.
    for (int64_t step = 1; step <= kSteps; ++step) {
      const double expected = eager[0].losses.at(step);
      EXPECT_LE(std::abs(graphs[0].losses.at(step) - expected) / expected, 2e-3) << "step " << step;
    }
  }
}

// Rank 0 finds the master port taken by another process: it fails at once with
// FAILURE_KIND_RENDEZVOUS and a message that says so (not a collective timeout).
TEST_F(TrainerTrainingTest, ATakenMasterPortIsARendezvousFailureNamingThePort) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int port = ntohs(address.sin_port);
  // Rank 0 of two, alone: it never gets as far as waiting for rank 1.
  auto process = Subprocess::Start(
      BaseFlags(2), {.merge_stdout = true,
                     .extra_env = {"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=2",
                                   "MASTER_ADDR=127.0.0.1", absl::StrCat("MASTER_PORT=", port)}});
  ASSERT_THAT(process, IsOk());
  auto exit = process->Wait(absl::Minutes(2));
  close(listener);
  ASSERT_THAT(exit, IsOk());
  TrainerRun run;
  run.exit_code = exit->exit_code;
  run.output = process->stderr_text();
  ParseReports(run);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("cannot listen on the master port ", port)));
  bool typed = false;
  for (const auto& report : run.reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_RENDEZVOUS;
  }
  EXPECT_TRUE(typed) << run.output;
}

// --cuda_graphs where graphs do not apply (the CPU here): the log says why, and the run is the
// same run bit for bit.
TEST_F(TrainerTrainingTest, CudaGraphsOnTheCpuSayWhyNotAndChangeNothing) {
  std::vector<std::string> flags = BaseFlags(3);
  TrainerRun plain = RunTrainer(flags);
  flags.push_back("--cuda_graphs");
  TrainerRun with_flag = RunTrainer(flags);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(with_flag.exit_code, 0) << with_flag.output;
  EXPECT_THAT(with_flag.output, HasSubstr("CUDA graphs: off: the model is not on a CUDA device"));
  EXPECT_THAT(plain.output, Not(HasSubstr("CUDA graphs")));
  ASSERT_EQ(with_flag.losses.size(), 3u);
  for (int64_t step = 1; step <= 3; ++step) {
    EXPECT_EQ(with_flag.losses.at(step), plain.losses.at(step)) << "step " << step;
  }
}

// Save under one layout, resume under another: the next 10 losses equal an uninterrupted run.
struct ReshardCase {
  int save_dp, save_zero, resume_dp, resume_zero;
  int save_tp = 1, save_pp = 1, resume_tp = 1, resume_pp = 1;
};

class ReshardTest : public TrainerTrainingTest,
                    public ::testing::WithParamInterface<ReshardCase> {};

TEST_P(ReshardTest, ResumedLossesEqualAnUninterruptedRun) {
  const ReshardCase& c = GetParam();
  const int n = 10;
  TrainerRun straight = RunTrainer(BaseFlags(2 * n, "", 2 * n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string dir = MakeTempDir("ckpt-reshard");
  auto flags = [&](int steps, int zero, int tp, int pp) {
    std::vector<std::string> f = BaseFlags(steps, dir, 2 * n);
    f.push_back(absl::StrCat("--zero_stage=", zero));
    f.push_back(absl::StrCat("--tensor_parallel=", tp));
    f.push_back(absl::StrCat("--pipeline_parallel=", pp));
    return f;
  };
  const int save_world = c.save_dp * c.save_tp * c.save_pp;
  const int resume_world = c.resume_dp * c.resume_tp * c.resume_pp;
  std::vector<TrainerRun> first = RunRanks(flags(n, c.save_zero, c.save_tp, c.save_pp), save_world);
  ASSERT_EQ(first.size(), static_cast<size_t>(save_world));
  ASSERT_EQ(first[0].exit_code, 0) << first[0].output;
  std::vector<TrainerRun> resumed =
      RunRanks(flags(2 * n, c.resume_zero, c.resume_tp, c.resume_pp), resume_world);
  ASSERT_EQ(resumed.size(), static_cast<size_t>(resume_world));
  ASSERT_EQ(resumed[0].exit_code, 0) << resumed[0].output;
  EXPECT_THAT(resumed[0].output,
              HasSubstr(absl::StrCat("written with dp ", c.save_dp, ", tp ", c.save_tp, ", pp ",
                                     c.save_pp, ", ZeRO ", c.save_zero)));
  ASSERT_EQ(resumed[0].losses.size(), static_cast<size_t>(n)) << resumed[0].output;
  for (int64_t step = n + 1; step <= 2 * n; ++step) {
    const double expected = straight.losses.at(step);
    EXPECT_LE(std::abs(resumed[0].losses.at(step) - expected) / expected, 1e-5) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ReshardTest,
    ::testing::Values(ReshardCase{4, 3, 2, 1}, ReshardCase{2, 1, 1, 0}, ReshardCase{1, 0, 4, 3},
                      ReshardCase{2, 3, 1, 3}, ReshardCase{1, 0, 1, 0, 2, 2, 1, 1},
                      ReshardCase{2, 1, 1, 0, 1, 1, 2, 1}),
    [](const ::testing::TestParamInfo<ReshardCase>& info) {
      const ReshardCase& c = info.param;
      auto layout = [](int dp, int tp, int pp, int zero) {
        return absl::StrCat("dp", dp, tp > 1 ? absl::StrCat("tp", tp) : "",
                            pp > 1 ? absl::StrCat("pp", pp) : "", "zero", zero);
      };
      return absl::StrCat(layout(c.save_dp, c.save_tp, c.save_pp, c.save_zero), "_to_",
                          layout(c.resume_dp, c.resume_tp, c.resume_pp, c.resume_zero));
    });

TEST_F(TrainerTrainingTest, CheckpointOfAnotherModelIsRefusedNamingTheTensor) {
  const std::string dir = MakeTempDir("ckpt-other-model");
  TrainerRun first = RunTrainer(BaseFlags(2, dir));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Same directory, a model with a wider MLP: every layer's MLP weights differ in shape.
  std::vector<std::string> flags = BaseFlags(4, dir);
  flags.push_back("--zero_stage=2");
  std::vector<TrainerRun> runs = RunRanks(
      [&] {
        std::vector<std::string> f = flags;
        for (auto& flag : f) {
          if (flag == "--preset=tiny-gpt2") flag = "--preset=tiny-llama";
        }
        return f;
      }(),
      2);
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_NE(runs[0].exit_code, 0);
  EXPECT_THAT(runs[0].output, HasSubstr("checkpoint"));
  EXPECT_THAT(runs[0].output,
              ::testing::ContainsRegex("tensor (model|exp_avg)[a-z_]*/[a-z_.0-9]+"));
  bool typed = false;
  for (const auto& report : runs[0].reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_CHECKPOINT_ERROR;
  }
  EXPECT_TRUE(typed) << runs[0].output;
}

// GPU: ZeRO-3 with bf16 autocast on one GPU (NCCL world of one, so every gather and
// reduce-scatter runs): the allocator's peak stays within 10% of the planner's estimate for the
// same layout. Part of the GPU checks; skipped without a CUDA device.
TEST_F(TrainerTrainingTest, GpuZero3Bf16PeakMemoryMatchesThePlanner) {
  if (!::torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int seq = 1024, micro = 8;
  std::vector<std::string> flags = {Trainer(),
                                    "--data=" + *data_dir_ + "/train-*.bin",
                                    "--preset=gpt2-124m",
                                    absl::StrCat("--seq_len=", seq),
                                    absl::StrCat("--global_batch=", micro),
                                    absl::StrCat("--micro_batch=", micro),
                                    "--steps=6",
                                    "--warmup=2",
                                    "--zero_stage=3",
                                    "--gpu=0"};
  std::vector<TrainerRun> runs = RunRanks(flags, 1);
  ASSERT_EQ(runs.size(), 1u);
  ASSERT_EQ(runs[0].exit_code, 0) << runs[0].output;
  int64_t peak = 0;
  for (const auto& report : runs[0].reports) {
    if (report.has_metrics() && report.metrics().step() > 1) {
      peak = std::max(peak, report.metrics().peak_memory_bytes());
    }
  }
  ASSERT_GT(peak, 0) << runs[0].output;

  v1::ModelSpec spec;
  spec.set_preset("gpt2-124m");
  auto summary = planner::ResolveModel(spec, seq);
  ASSERT_THAT(summary, IsOk());
  auto device = planner::DevicePreset("h100-sxm");
  ASSERT_THAT(device, IsOk());
  planner::Workload workload;
  workload.dims = summary->dims();
  workload.seq_len = seq;
  workload.global_batch = micro;
  workload.precision = v1::PRECISION_BF16;
  planner::LayoutChoice layout;
  layout.zero = 3;
  layout.micro_batch = micro;
  planner::ClusterShape cluster;
  cluster.device = *device;
  cluster.gpus = 1;
  cluster.gpus_per_node = 1;
  const v1::MemoryEstimate estimate = planner::EstimateMemory(workload, layout, cluster).at(0);
  // The allocator's peak has no CUDA context or cuBLAS workspace in it: compare without the
  // planner's fixed workspace term.
  const int64_t planned = estimate.total_bytes() - cluster.device.workspace_bytes();
  // The planner's terms too: when the two part, the log says which term to look at.
  std::cout << "ZeRO-3 bf16 gpt2-124m seq " << seq << " micro " << micro << ": peak " << peak
            << " bytes, planner " << planned << " bytes (" << estimate.ShortDebugString() << ")\n";
  EXPECT_NEAR(static_cast<double>(peak), static_cast<double>(planned), 0.10 * planned);
}

}  // namespace
}  // namespace tessera
