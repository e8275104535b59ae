// checkpoint_bench: how fast the trainer saves and loads a checkpoint of
// about 1 GB of model weights and AdamW state, next to a plain sequential
// write and read of the same bytes in the same directory, measured in the same
// run and interleaved (ours, plain, ours, plain, ...). "Ours" is the trainer's
// own path (trainer/engine/checkpointing.cc): PrepareStaging, WriteTrainingState's
// safetensors shard of slices and CommitCheckpoint for a save;
// ResumeLatest (the digest verified on a thread beside the slices' reads) for a
// load. Both sides are durable (fsync)
// before the clock stops, and both read with the file dropped from the page
// cache. Prints a summary and writes $TESSERA_BENCH_RESULTS/checkpoint.json
// (scripts/bench.sh sets the TESSERA_BENCH_* variables).
#include <ATen/CPUGeneratorImpl.h>
#include <sys/statvfs.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_env.h"
#include "bench/checkpoint_bench_files.h"
#include "common/command_line.h"
#include "common/errno_status.h"
#include "common/status_macros.h"
#include "common/xxh3.h"
#include "nlohmann/json.hpp"
#include "planner/model_config.h"
#include "trainer/engine/adamw.h"
#include "trainer/engine/checkpointing.h"
#include "trainer/engine/sharded_engine.h"
#include "trainer/engine/training_state.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/shard_file.h"
#include "trainer/model/model.h"
#include "trainer/torch_pch.h"

ABSL_FLAG(std::string, dir, "",
          "Directory in which to create the scratch directory (both sides write there); "
          "empty: $TMPDIR, else /tmp.");
ABSL_FLAG(int, runs, 7,
          "Timed runs of each of the four operations (at least 1; 5 or more for "
          "a result worth quoting).");
ABSL_FLAG(int, layers, 12, "GPT-2 model: number of layers.");
ABSL_FLAG(bool, verify_then_load, false,
          "Our load as before digests were checked during it: FindLatestCheckpoint hashes the "
          "shard, then its slices are read (a second read, from the page cache), for an A/B "
          "against the default ResumeLatest.");
ABSL_FLAG(bool, copy_before_step, false,
          "Asynchronous saves as they were before the copy overlapped the step: the step waits "
          "for the copy right after Start (AwaitSnapshot), for an A/B in the same binary.");
ABSL_FLAG(int, hidden, 768, "GPT-2 model: hidden size (a multiple of 64; heads of 64).");
ABSL_FLAG(int, vocab, 8192, "GPT-2 model: vocabulary size.");

namespace tessera::bench {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

// Where scratch files go when --dir is not given (POSIX's TMPDIR).
constexpr char kTmpDirEnv[] = "TMPDIR";

constexpr char kResultsFileName[] = "checkpoint.json";
// Throughput unit: MB = 10^6 bytes.
constexpr double kBytesPerMb = 1e6;
// Free space demanded of the scratch file system, in multiples of the state
// size: two iterations' checkpoints and plain files exist at the same time.
constexpr double kFreeSpaceFactor = 4.5;
// Prefaulted beyond the state's size before each operation: archive
// headers, manifests, the RNG state.
constexpr size_t kPrefaultSlackBytes = size_t{64} << 20;
// Sequence length of the model's learned positions (GPT-2's).
constexpr int kMaxSeqLen = 1024;

struct BenchOptions {
  std::string parent_dir;
  int runs = 7;
  int num_layers = 12;
  int hidden_size = 768;
  int vocab_size = 8192;
  bool verify_then_load = false;
  bool copy_before_step = false;
  std::string results_dir;
  std::string commit;
  std::string date;
  std::string machine;
};

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  if (n == 0) return 0;
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// ---------------------------------------------------------------------------
// Ours: the trainer's checkpoint code on a trainer-shaped model and optimizer.

// What a rank holds between steps: the model and the trainer's step engine (ZeRO 0, one rank)
// with its AdamW moments populated, built as trainer/runtime/train.cc builds them.
struct TrainerState {
  v1::ModelSummary summary;
  trainer::CausalLM model{nullptr};
  std::unique_ptr<trainer::ShardedEngine> engine;
  int64_t state_bytes = 0;
};

absl::StatusOr<TrainerState> BuildTrainerState(const BenchOptions& options) {
  v1::ModelSpec spec;
  v1::ModelDims* dims = spec.mutable_dims();
  dims->set_architecture(v1::ARCHITECTURE_GPT2);
  dims->set_num_layers(options.num_layers);
  dims->set_hidden_size(options.hidden_size);
  dims->set_num_attention_heads(std::max(1, options.hidden_size / 64));
  dims->set_vocab_size(options.vocab_size);
  dims->set_max_seq_len(kMaxSeqLen);
  dims->set_tie_embeddings(true);
  ASSIGN_OR_RETURN(v1::ModelSummary summary, planner::ResolveModel(spec, kMaxSeqLen));

  TrainerState state;
  state.summary = summary;
  torch::manual_seed(1234);
  state.model = trainer::CausalLM(summary.dims(), planner::kDefaultInitStd);
  trainer::ShardedEngineOptions engine_options;
  engine_options.weight_decay = 0.1;
  state.engine = std::make_unique<trainer::ShardedEngine>(state.model, engine_options);
  // Moments exist from the start (zeros); a step with random gradients makes them realistic.
  for (const trainer::TensorRange& range : state.engine->LoadRanges()) {
    if (range.name.rfind("exp_avg", 0) == 0) range.data.normal_(0, 1e-3).abs_();
  }
  const trainer::EngineMemory memory = state.engine->Memory();
  state.state_bytes = memory.parameter_bytes + memory.moment_bytes;
  return state;
}

// SaveCheckpoint of trainer/engine/checkpointing.cc on rank 0 of a one-rank job, call for call. Phases:
// prepare_staging, serialize_write (WriteTrainingState: the slices copied to host memory and
// written as a safetensors shard through WriteHashedFile, XXH3-128 on the way, no fsync), commit
// (CommitCheckpoint with the digest: fsync of the shard, manifest.pb/.json written and fsynced,
// rename, directory fsyncs).
absl::StatusOr<PhaseTimes> SaveOurs(TrainerState& state, const std::string& root, int64_t step) {
  try {
    PhaseClock clock;
    RETURN_IF_ERROR(trainer::PrepareStaging(root, step).status());
    clock.Lap("prepare_staging");
    const std::string shard = trainer::SliceShardFileName(/*rank=*/0);
    ASSIGN_OR_RETURN(trainer::WrittenShard written,
                     trainer::WriteTrainingState(
                         absl::StrCat(trainer::StagingDir(root, step), "/", shard), *state.engine,
                         /*rank=*/0, {{"tessera.job_id", "checkpoint-bench"}}));
    clock.Lap("serialize_write");
    v1::CheckpointManifest manifest;
    manifest.set_job_id("checkpoint-bench");
    manifest.set_step(step);
    manifest.mutable_layout()->set_data_parallel(1);
    *manifest.mutable_model() = state.summary;
    RETURN_IF_ERROR(trainer::CommitCheckpoint(root, step, std::move(manifest), /*world_size=*/1,
                                              /*keep_last=*/0, {{shard, written.xxh3_128}})
                        .status());
    clock.Lap("commit");
    return std::move(clock).Take();
  } catch (const c10::Error& error) {
    return absl::InternalError(
        absl::StrCat("saving step ", step, ": ", error.what_without_backtrace()));
  }
}

// trainer/engine/checkpointing.cc ResumeLatest as the one rank of a single-process job, the call the
// trainer makes: the newest checkpoint whose manifest and shard sizes check, its digest computed
// on a thread beside the reads of its slices into the engine (the checkpoint read once), the RNG
// state. One phase, resume. With `verify_then_load` (--verify_then_load), the load as it was
// before: FindLatestCheckpoint hashing the shard (phase find_latest_verify), then the reader
// (open) and ReadTrainingState from the page cache (apply). Returns the loaded checkpoint's
// directory in `*path`.
absl::StatusOr<PhaseTimes> LoadOurs(TrainerState& state, const std::string& root,
                                    bool verify_then_load, std::string* path) {
  try {
    PhaseClock clock;
    if (verify_then_load) {
      ASSIGN_OR_RETURN(std::optional<trainer::FoundCheckpoint> found,
                       trainer::FindLatestCheckpoint(root, nullptr));
      if (!found.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat(root, ": no checkpoint verifies"));
      }
      clock.Lap("find_latest_verify");
      ASSIGN_OR_RETURN(trainer::ShardedCheckpointReader reader,
                       trainer::ShardedCheckpointReader::Open(found->path, found->manifest));
      clock.Lap("open");
      RETURN_IF_ERROR(trainer::ReadTrainingState(reader, *state.engine, /*rank=*/0));
      clock.Lap("apply");
      *path = std::move(found->path);
      return std::move(clock).Take();
    }
    v1::TrainerTask task;
    task.set_checkpoint_directory(root);
    const trainer::CheckpointContext context{
        .task = &task, .rank = 0, .world = 1, .engine = state.engine.get()};
    ASSIGN_OR_RETURN(std::optional<trainer::Resumed> resumed, trainer::ResumeLatest(context));
    if (!resumed.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(root, ": no checkpoint to resume from"));
    }
    clock.Lap("resume");
    *path = std::move(resumed->path);
    return std::move(clock).Take();
  } catch (const c10::Error& error) {
    return absl::InternalError(
        absl::StrCat("loading from ", root, ": ", error.what_without_backtrace()));
  }
}

// ---------------------------------------------------------------------------
// The runs.

struct Series {
  std::vector<PhaseTimes> runs;

  std::vector<double> MbPerSecond(int64_t bytes) const {
    std::vector<double> rates;
    for (const PhaseTimes& run : runs) rates.push_back(bytes / kBytesPerMb / run.Total());
    return rates;
  }
  double MedianMbPerSecond(int64_t bytes) const { return Median(MbPerSecond(bytes)); }
  double MedianSeconds() const {
    std::vector<double> seconds;
    for (const PhaseTimes& run : runs) seconds.push_back(run.Total());
    return Median(seconds);
  }
  double BestMbPerSecond(int64_t bytes) const {
    const std::vector<double> rates = MbPerSecond(bytes);
    return *std::max_element(rates.begin(), rates.end());
  }
  // Median seconds of each phase, in the phases' order.
  std::vector<std::pair<std::string, double>> MedianPhases() const {
    std::vector<std::pair<std::string, double>> medians;
    if (runs.empty()) return medians;
    for (size_t i = 0; i < runs.front().phases.size(); ++i) {
      std::vector<double> seconds;
      for (const PhaseTimes& run : runs) seconds.push_back(run.phases[i].second);
      medians.emplace_back(runs.front().phases[i].first, Median(seconds));
    }
    return medians;
  }
};

// /proc/loadavg's 1, 5 and 15 minute figures as written there.
std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return absl::StrCat(one, " ", five, " ", fifteen);
}

struct Results {
  TrainerState* state = nullptr;
  std::string load_average_before;
  std::string load_average_after;
  std::string scratch;
  std::string file_system;
  int64_t shard_bytes = 0;
  int64_t checkpoint_bytes = 0;
  Series save_ours, save_plain, load_ours, load_plain;
  // Per run, the side that saved and loaded first: "ours" or "plain".
  std::vector<std::string> first;
  double max_resident_after_drop = 0;
  // Diagnostics, each measured once after the runs.
  double digest_in_memory_mb_s = 0;
  double serialize_to_memory_mb_s = 0;
  // The copy of the state to host memory alone, into reused buffers by this thread and the
  // intra-op pool: what an asynchronous save blocked training for when Start took the copy.
  // Median of 5.
  double snapshot_copy_seconds = 0;
  // An asynchronous save during training, as the trainer runs it (MeasureAsyncSave). Medians.
  double async_blocked_seconds = 0;   // Start + AwaitSnapshot: the trainer's metric
  double step_seconds = 0;            // a training step without a save
  double step_with_save_seconds = 0;  // the step right after a save's Start
  int step_tokens = 0;
  double plain_read_warm_mb_s = 0;
  double digest_file_warm_mb_s = 0;
};

absl::StatusOr<int64_t> DirectoryBytes(const std::string& dir) {
  int64_t bytes = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.is_regular_file()) bytes += static_cast<int64_t>(entry.file_size());
  }
  if (error) return absl::InternalError(absl::StrCat(dir, ": cannot list: ", error.message()));
  return bytes;
}

// Deletes `path` (a file or a directory tree) when it exists, then lets the
// file system finish the deletion's work before the next timed operation.
absl::Status RemoveAndSettle(const std::string& path, const std::string& scratch) {
  std::error_code error;
  std::filesystem::remove_all(path, error);
  if (error) return absl::InternalError(absl::StrCat(path, ": cannot remove: ", error.message()));
  return SettleFileSystem(scratch);
}

// The CPU cost of a shard without a disk: host copies, header and XXH3-128, written to /dev/null.
absl::StatusOr<double> SerializeToMemoryMbPerSecond(TrainerState& state) {
  try {
    const Clock::time_point start = Clock::now();
    ASSIGN_OR_RETURN(trainer::WrittenShard written,
                     trainer::WriteTrainingState("/dev/null", *state.engine, /*rank=*/0, {}));
    const double seconds = SecondsSince(start);
    return static_cast<double>(written.size_bytes) / kBytesPerMb / seconds;
  } catch (const c10::Error& error) {
    return absl::InternalError(error.what_without_backtrace());
  }
}

// One warm-up iteration (not recorded), then `options.runs` iterations of
// both saves, then both loads, the sides taking turns to go first. Before
// each timed operation, outside the clock: the files that operation's side
// wrote in the previous iteration are deleted (and the deletion settled), the
// file about to be read is dropped from the page cache, and as much memory as
// the operation will allocate is prefaulted (PrefaultFreeMemory), so both
// sides start from the same state.
// An asynchronous save during training, as trainer/runtime/train.cc runs one: Start after a step, then
// the next step's forward and backward, AwaitSnapshot, and its optimizer step. Each round times a
// step with a save and a step without one, in alternating order, on the bench's model (one
// sequence of 256 tokens); the save's write is waited for outside the clock before the next
// round (a trainer goes on with further steps meanwhile), and free memory is prefaulted before
// each step as before each save above. Blocked = Start + AwaitSnapshot, the
// trainer's checkpoint_blocked_seconds; the step's slowdown also counts what the background copy
// and write take from the step in cores and memory bandwidth.
absl::Status MeasureAsyncSave(TrainerState& state, const std::string& scratch,
                              const BenchOptions& options, Results& results) {
  constexpr int kSeq = 256;
  v1::TrainerTask task;
  task.set_job_id("checkpoint-bench");
  const std::string root = absl::StrCat(scratch, "/async-saves");
  task.set_checkpoint_directory(root);
  task.mutable_spec()->mutable_checkpoint()->set_keep_last(1);
  trainer::CheckpointContext context{
      .task = &task, .rank = 0, .world = 1, .engine = state.engine.get()};
  trainer::AsyncCheckpointer checkpointer(context);
  torch::manual_seed(5);
  const at::Tensor inputs = torch::randint(0, options.vocab_size, {1, kSeq}, torch::kInt64);
  const at::Tensor targets = torch::randint(0, options.vocab_size, {1, kSeq}, torch::kInt64);
  int64_t saves = 0;
  auto step = [&](bool save, double* blocked) -> absl::StatusOr<double> {
    const Clock::time_point start = Clock::now();
    if (save) {
      trainer::CheckpointState checkpoint_state;
      checkpoint_state.step = ++saves;
      RETURN_IF_ERROR(checkpointer.Start(checkpoint_state, false, nullptr));
      *blocked = checkpointer.last_blocked_seconds();
      if (options.copy_before_step) *blocked += checkpointer.AwaitSnapshot();
    }
    try {
      state.engine->ForwardBackward(inputs, targets, 1.0, /*last=*/true);
      if (save) *blocked += checkpointer.AwaitSnapshot();
      state.engine->Step(1e-5, 1.0);
    } catch (const c10::Error& error) {
      return absl::InternalError(absl::StrCat("training step: ", error.what_without_backtrace()));
    }
    return SecondsSince(start);
  };
  std::vector<double> blocked, plain_steps, save_steps;
  // Warm-up: the first save allocates its host buffers; later ones write over them.
  for (int round = -1; round < options.runs; ++round) {
    const bool save_first = round % 2 == 0;
    double without = 0, with = 0, waited = 0;
    for (bool save : {save_first, !save_first}) {
      // As before the saves above: the page cache the write fills gets warm pages, not pages
      // this VM's balloon has handed back to the host.
      RETURN_IF_ERROR(PrefaultFreeMemory(static_cast<size_t>(results.shard_bytes)));
      ASSIGN_OR_RETURN(double seconds, step(save, &waited));
      (save ? with : without) = seconds;
      if (save) RETURN_IF_ERROR(checkpointer.Wait());
    }
    if (round < 0) continue;
    blocked.push_back(waited);
    plain_steps.push_back(without);
    save_steps.push_back(with);
    std::cout << absl::StrFormat(
                     "  async round %d/%d: step %.3f s, step with a save %.3f s, blocked %.3f s\n",
                     round + 1, options.runs, without, with, waited)
              << std::flush;
  }
  results.async_blocked_seconds = Median(blocked);
  results.step_seconds = Median(plain_steps);
  results.step_with_save_seconds = Median(save_steps);
  results.step_tokens = kSeq;
  std::error_code ignored;
  std::filesystem::remove_all(root, ignored);
  return absl::OkStatus();
}

absl::Status RunIterations(const BenchOptions& options, Results& results) {
  TrainerState& state = *results.state;
  const std::string root = absl::StrCat(results.scratch, "/checkpoints");
  const std::string plain_dir = absl::StrCat(results.scratch, "/plain");
  std::error_code error;
  std::filesystem::create_directories(plain_dir, error);
  if (error) {
    return absl::InternalError(absl::StrCat(plain_dir, ": cannot create: ", error.message()));
  }
  // The same bytes as our shard, and the plain side's read destination.
  std::string plain_bytes;
  // A parameter whose values a load must bring back.
  at::Tensor probe = state.model->parameters().front();
  const at::Tensor probe_saved = probe.detach().clone();
  // The page cache each operation fills. Our load also allocates new tensors
  // of that size, but only after hashing the file: seconds later, when
  // memory freed now has gone back to the host anyway.
  const size_t file_bytes = static_cast<size_t>(state.state_bytes) + kPrefaultSlackBytes;
  std::string previous_checkpoint, previous_plain_file;

  for (int iteration = 0; iteration <= options.runs; ++iteration) {
    const bool warmup = iteration == 0;
    // Whichever side goes second meets the memory and page cache the first
    // one left; the prefaulting evens that out, and taking turns cancels what
    // it misses. Ours goes first on odd runs and in the warm-up, which needs
    // our shard's bytes.
    const bool ours_first = warmup || iteration % 2 == 1;
    const int64_t step = iteration + 1;
    const std::string checkpoint = absl::StrCat(root, "/", trainer::CheckpointDirName(step));
    const std::string plain_file = absl::StrCat(plain_dir, "/plain-", step, ".bin");

    PhaseTimes save_ours, save_plain, load_ours, load_plain;
    auto save_ours_now = [&]() -> absl::Status {
      if (!previous_checkpoint.empty()) {
        RETURN_IF_ERROR(RemoveAndSettle(previous_checkpoint, results.scratch));
      }
      RETURN_IF_ERROR(PrefaultFreeMemory(file_bytes));
      ASSIGN_OR_RETURN(save_ours, SaveOurs(state, root, step));
      if (!warmup) return absl::OkStatus();
      const std::string shard = absl::StrCat(checkpoint, "/", trainer::SliceShardFileName(0));
      results.shard_bytes = static_cast<int64_t>(std::filesystem::file_size(shard, error));
      if (error) return absl::InternalError(absl::StrCat(shard, ": ", error.message()));
      ASSIGN_OR_RETURN(results.checkpoint_bytes, DirectoryBytes(checkpoint));
      plain_bytes.assign(static_cast<size_t>(results.shard_bytes), '\0');
      return ReadPlain(shard, &plain_bytes).status();
    };
    auto save_plain_now = [&]() -> absl::Status {
      if (!previous_plain_file.empty()) {
        RETURN_IF_ERROR(RemoveAndSettle(previous_plain_file, results.scratch));
      }
      RETURN_IF_ERROR(PrefaultFreeMemory(file_bytes));
      ASSIGN_OR_RETURN(save_plain, WritePlain(plain_file, plain_bytes));
      return absl::OkStatus();
    };
    auto load_ours_now = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(double resident, DropTreeFromPageCache(checkpoint));
      results.max_resident_after_drop = std::max(results.max_resident_after_drop, resident);
      {
        torch::NoGradGuard no_grad;
        probe.zero_();
      }
      RETURN_IF_ERROR(PrefaultFreeMemory(file_bytes));
      std::string loaded;
      ASSIGN_OR_RETURN(load_ours, LoadOurs(state, root, options.verify_then_load, &loaded));
      if (loaded != checkpoint || !torch::equal(probe, probe_saved)) {
        return absl::InternalError(absl::StrCat(
            "load of ", checkpoint, " did not restore the saved weights (loaded ", loaded, ")"));
      }
      return absl::OkStatus();
    };
    auto load_plain_now = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(double resident, DropTreeFromPageCache(plain_dir));
      results.max_resident_after_drop = std::max(results.max_resident_after_drop, resident);
      RETURN_IF_ERROR(PrefaultFreeMemory(file_bytes));
      ASSIGN_OR_RETURN(load_plain, ReadPlain(plain_file, &plain_bytes));
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(ours_first ? save_ours_now() : save_plain_now());
    RETURN_IF_ERROR(ours_first ? save_plain_now() : save_ours_now());
    RETURN_IF_ERROR(ours_first ? load_ours_now() : load_plain_now());
    RETURN_IF_ERROR(ours_first ? load_plain_now() : load_ours_now());
    previous_checkpoint = checkpoint;
    previous_plain_file = plain_file;

    if (iteration == options.runs) {
      // Diagnostics on the files of the last iteration, now in the page cache.
      Clock::time_point start = Clock::now();
      RETURN_IF_ERROR(ReadPlain(plain_file, &plain_bytes).status());
      results.plain_read_warm_mb_s = results.shard_bytes / kBytesPerMb / SecondsSince(start);
      start = Clock::now();
      RETURN_IF_ERROR(Xxh3File(plain_file).status());
      results.digest_file_warm_mb_s = results.shard_bytes / kBytesPerMb / SecondsSince(start);
      start = Clock::now();
      Xxh3Hex(plain_bytes);
      results.digest_in_memory_mb_s = results.shard_bytes / kBytesPerMb / SecondsSince(start);
    }
    if (warmup) {
      std::cout << "  warm-up done\n" << std::flush;
      continue;
    }
    std::cout
        << absl::StrFormat(
               "  run %d/%d (%s first): save ours %.2f s, plain %.2f s; load ours %.2f s, plain "
               "%.2f s\n",
               iteration, options.runs, ours_first ? "ours" : "plain", save_ours.Total(),
               save_plain.Total(), load_ours.Total(), load_plain.Total())
        << std::flush;
    results.first.push_back(ours_first ? "ours" : "plain");
    results.save_ours.runs.push_back(std::move(save_ours));
    results.save_plain.runs.push_back(std::move(save_plain));
    results.load_ours.runs.push_back(std::move(load_ours));
    results.load_plain.runs.push_back(std::move(load_plain));
  }
  ASSIGN_OR_RETURN(results.serialize_to_memory_mb_s, SerializeToMemoryMbPerSecond(state));
  {
    // Each snapshot writes over the previous one's buffers (the first, untimed, allocates them);
    // copied by this thread and the intra-op pool (StateCopy::Finish), as fast as a copy on the
    // training thread goes.
    std::vector<double> copies;
    trainer::TrainingStateSnapshot snapshot = trainer::SnapshotTrainingState(*state.engine);
    for (int i = 0; i < 5; ++i) {
      const Clock::time_point start = Clock::now();
      trainer::StateCopy copy(trainer::CaptureTrainingState(*state.engine), &snapshot);
      copy.Finish();
      ASSIGN_OR_RETURN(snapshot, copy.Take());
      copies.push_back(SecondsSince(start));
    }
    results.snapshot_copy_seconds = Median(copies);
  }
  return MeasureAsyncSave(state, results.scratch, options, results);
}

// ---------------------------------------------------------------------------
// Reporting.

Json SeriesJson(const Series& series, int64_t bytes) {
  const std::vector<double> rates = series.MbPerSecond(bytes);
  Json json;
  json["median_mb_per_s"] = Median(rates);
  json["min_mb_per_s"] = *std::min_element(rates.begin(), rates.end());
  json["max_mb_per_s"] = *std::max_element(rates.begin(), rates.end());
  json["runs_mb_per_s"] = rates;
  std::vector<double> seconds;
  for (const PhaseTimes& run : series.runs) seconds.push_back(run.Total());
  json["runs_seconds"] = seconds;
  std::vector<double> cpu_seconds;
  for (const PhaseTimes& run : series.runs) cpu_seconds.push_back(run.cpu_seconds);
  json["median_cpu_seconds"] = Median(cpu_seconds);
  json["runs_cpu_seconds"] = cpu_seconds;
  Json phases = Json::object();
  for (size_t i = 0; i < series.runs.front().phases.size(); ++i) {
    std::vector<double> phase_seconds;
    for (const PhaseTimes& run : series.runs) phase_seconds.push_back(run.phases[i].second);
    phases[series.runs.front().phases[i].first] = {{"median_seconds", Median(phase_seconds)},
                                                   {"runs_seconds", phase_seconds}};
  }
  json["phases"] = phases;
  return json;
}

Json ComparisonJson(const Series& ours, const Series& plain, int64_t bytes) {
  Json json;
  json["ours"] = SeriesJson(ours, bytes);
  json["plain"] = SeriesJson(plain, bytes);
  json["ratio_ours_over_plain"] = ours.MedianMbPerSecond(bytes) / plain.MedianMbPerSecond(bytes);
  json["ratio_best_ours_over_best_plain"] =
      ours.BestMbPerSecond(bytes) / plain.BestMbPerSecond(bytes);
  return json;
}

Json ResultsJson(const BenchOptions& options, const Results& results) {
  const TrainerState& state = *results.state;
  const v1::ModelDims& dims = state.summary.dims();
  Json json;
  json["benchmark"] = "checkpoint";
  json["commit"] = options.commit;
  json["date"] = options.date;
  json["machine"] = options.machine;
  json["load_average"] = {{"before", results.load_average_before},
                          {"after", results.load_average_after},
                          {"cores", std::thread::hardware_concurrency()}};
  json["model"] = {{"architecture", "gpt2"},
                   {"num_layers", dims.num_layers()},
                   {"hidden_size", dims.hidden_size()},
                   {"vocab_size", dims.vocab_size()},
                   {"parameters", planner::CountParameters(dims)},
                   {"dtype", "float32"},
                   {"device", "cpu"}};
  json["bytes"] = {{"state", state.state_bytes},
                   {"shard", results.shard_bytes},
                   {"checkpoint_directory", results.checkpoint_bytes},
                   {"plain_file", results.shard_bytes},
                   {"throughput_basis", results.shard_bytes}};
  json["scratch"] = {{"directory", results.scratch}, {"file_system", results.file_system}};
  json["runs"] = options.runs;
  json["load_mode"] = options.verify_then_load ? "verify_then_load" : "resume_latest";
  json["async_copy"] = options.copy_before_step ? "before_step" : "during_step";
  json["warmup_runs"] = 1;
  json["runs_first"] = results.first;
  json["save"] = ComparisonJson(results.save_ours, results.save_plain, results.shard_bytes);
  json["load"] = ComparisonJson(results.load_ours, results.load_plain, results.shard_bytes);
  json["diagnostics"] = {
      {"xxh3_128_in_memory_mb_per_s", results.digest_in_memory_mb_s},
      {"xxh3_128_file_page_cache_mb_per_s", results.digest_file_warm_mb_s},
      {"plain_read_page_cache_mb_per_s", results.plain_read_warm_mb_s},
      {"serialize_to_memory_mb_per_s", results.serialize_to_memory_mb_s},
      {"snapshot_copy_seconds", results.snapshot_copy_seconds},
      {"max_resident_fraction_after_cache_drop", results.max_resident_after_drop}};
  const double sync_save = results.save_ours.MedianSeconds();
  json["async_save"] = {
      {"blocked_seconds", results.async_blocked_seconds},
      {"blocked_fraction_of_sync_save", results.async_blocked_seconds / sync_save},
      {"step_seconds", results.step_seconds},
      {"step_with_save_seconds", results.step_with_save_seconds},
      {"step_slowdown_fraction_of_sync_save",
       (results.step_with_save_seconds - results.step_seconds) / sync_save},
      {"step_tokens", results.step_tokens},
      {"sync_save_seconds", sync_save}};
  json["method"] = {
      {"units",
       "MB = 10^6 bytes. Every MB/s figure, ours and plain, is the shard's size (the plain file "
       "has exactly as many bytes) divided by the operation's wall time. ratio_ours_over_plain is "
       "median over median; ratio_best_ours_over_best_plain compares each side's fastest run, "
       "the closer figure to a quiet machine when other processes or the VM's memory balloon "
       "slowed some runs."},
      {"order",
       "One warm-up iteration, not recorded, then per run: both saves, then both loads, the two "
       "sides interleaved; the side that goes first alternates (ours on odd runs; runs_first). "
       "Each iteration writes a new step and a new plain file."},
      {"preparation",
       "Right before each timed operation, outside the clock: the files its side wrote in the "
       "previous iteration are deleted and the file system settled with syncfs (so deletion and "
       "discard work, the root file system being mounted with -o discard here, is not charged to "
       "it); for a load, the files to be read are dropped from the page cache; then as much "
       "anonymous memory as the operation's page cache (the state size plus 64 MiB) is faulted in "
       "and unmapped. "
       "This VM's balloon reports free pages to the host: memory free for more than about two "
       "seconds costs about a second per GB of host faults when used again. Without the "
       "prefaulting, whichever side went second paid that: plain's 1.1 GB write took 0.3-0.6 s "
       "going first and 1.7-2.5 s going second."},
      {"save_ours",
       "trainer/engine/checkpointing.cc SaveCheckpoint for rank 0 of one rank: PrepareStaging; "
       "WriteTrainingState (every parameter and AdamW moment slice and the CPU RNG state as a "
       "safetensors shard, through WriteHashedFile: XXH3-128 computed while writing); "
       "CommitCheckpoint (world_size 1, "
       "keep_last 0) with that digest: fsync of the shard, manifest.pb and manifest.json written "
       "and fsynced, fsync of the staging directory, rename into place, fsync of the root."},
      {"save_plain",
       "write() of the shard's bytes from memory in 8 MiB blocks to a new file in the same file "
       "system, then fsync of the file and of its directory (dd bs=8M conv=fsync, plus the "
       "directory)."},
      {"durability",
       "Both sides fsync all they wrote, and the directories, before the clock stops."},
      {"load_ours",
       "trainer/engine/checkpointing.cc ResumeLatest for the one rank of a single-process job: "
       "FindLatestCheckpoint without digests (lists the root, parses manifest.pb, checks the "
       "shard's size), ShardedCheckpointReader::Open, then ReadTrainingState (pread of every "
       "slice straight into the engine's tensors on up to 4 threads, RNG set_state) while "
       "another thread computes the shard's XXH3-128 and compares it with the manifest's. "
       "Loading here = reading + digest verify + restoring the tensors."},
      {"load_plain",
       "read() of the plain file in 8 MiB blocks into an already-touched buffer of its size; no "
       "hashing, no parsing."},
      {"page_cache",
       "Cold reads on both sides: before each load, every file to be read is fdatasync'ed and "
       "dropped with posix_fadvise(POSIX_FADV_DONTNEED); mincore then reports the resident "
       "fraction (max in diagnostics). This empties this kernel's page cache only: a hypervisor "
       "or device cache below it may still serve the reads."},
      {"diagnostics",
       "Measured once, after the runs: XXH3-128 of the bytes in memory; Xxh3File and a plain "
       "read of the plain file while it is in the page cache; WriteTrainingState into /dev/null "
       "(host copies, header and digest, no file)."},
      {"cpu_seconds",
       "User + system CPU time of this process (getrusage) over each operation. The benchmark "
       "runs on one thread; when wall time is well above CPU time outside of I/O waits, other "
       "processes were competing for the cores (see load_average)."},
      {"async_save",
       "After the runs, per round (runs rounds after one warm-up round) a training step of the "
       "model without a save and one right after AsyncCheckpointer::Start, in alternating "
       "order, the save's write waited for outside the clock. blocked = Start (barrier, "
       "capture) + AwaitSnapshot before the optimizer step, as the trainer reports it; the "
       "slowdown is the step with a save minus the step without, medians, also counting the "
       "background copy's and write's use of cores and memory bandwidth. Fractions are of the "
       "median synchronous save above."},
      {"device",
       "Tensors on the CPU. A GPU trainer's save also copies device to host inside save_to, and "
       "its load copies host to device."}};
  return json;
}

void PrintSide(const char* label, const Series& series, int64_t bytes) {
  const std::vector<double> rates = series.MbPerSecond(bytes);
  std::vector<std::string> runs;
  for (double rate : rates) runs.push_back(absl::StrFormat("%.0f", rate));
  std::vector<double> cpu_seconds;
  for (const PhaseTimes& run : series.runs) cpu_seconds.push_back(run.cpu_seconds);
  std::cout << absl::StrFormat(
      "  %-11s median %7.1f MB/s  [min %7.1f, max %7.1f]  runs: %s  (median CPU %.2f s)\n", label,
      Median(rates), *std::min_element(rates.begin(), rates.end()),
      *std::max_element(rates.begin(), rates.end()), absl::StrJoin(runs, " "), Median(cpu_seconds));
  std::vector<std::string> phases;
  for (const auto& [name, seconds] : series.MedianPhases()) {
    phases.push_back(absl::StrFormat("%s %.3f", name, seconds));
  }
  std::cout << "              phases, median s: " << absl::StrJoin(phases, ", ") << "\n";
}

void PrintSummary(const Results& results) {
  const int64_t bytes = results.shard_bytes;
  std::cout << absl::StrFormat(
      "checkpoint: shard %.1f MB (state %.1f MB), in %s (%s); load average %s before, %s after\n",
      bytes / kBytesPerMb, results.state->state_bytes / kBytesPerMb, results.scratch,
      results.file_system, results.load_average_before, results.load_average_after);
  PrintSide("save ours", results.save_ours, bytes);
  PrintSide("save plain", results.save_plain, bytes);
  std::cout << absl::StrFormat(
      "  save ratio ours/plain: %.2f (best run over best run %.2f)\n",
      results.save_ours.MedianMbPerSecond(bytes) / results.save_plain.MedianMbPerSecond(bytes),
      results.save_ours.BestMbPerSecond(bytes) / results.save_plain.BestMbPerSecond(bytes));
  const double sync_save = results.save_ours.MedianSeconds();
  std::cout << absl::StrFormat(
      "  async save: training blocked %.3f s = %.1f%% of the median synchronous save's %.3f s "
      "(the copy alone: %.3f s = %.1f%%); a %d-token step %.3f s, with a save %.3f s (+%.1f%% "
      "of a synchronous save)\n",
      results.async_blocked_seconds, 100 * results.async_blocked_seconds / sync_save, sync_save,
      results.snapshot_copy_seconds, 100 * results.snapshot_copy_seconds / sync_save,
      results.step_tokens, results.step_seconds, results.step_with_save_seconds,
      100 * (results.step_with_save_seconds - results.step_seconds) / sync_save);
  PrintSide("load ours", results.load_ours, bytes);
  PrintSide("load plain", results.load_plain, bytes);
  std::cout << absl::StrFormat(
      "  load ratio ours/plain: %.2f (best run over best run %.2f)\n",
      results.load_ours.MedianMbPerSecond(bytes) / results.load_plain.MedianMbPerSecond(bytes),
      results.load_ours.BestMbPerSecond(bytes) / results.load_plain.BestMbPerSecond(bytes));
  std::cout << absl::StrFormat(
      "  diagnostics: XXH3-128 in memory %.0f MB/s, Xxh3File from page cache %.0f MB/s, "
      "plain read from page cache %.0f MB/s, save_to without a file %.0f MB/s; page cache left "
      "after drops %.1f%%\n",
      results.digest_in_memory_mb_s, results.digest_file_warm_mb_s, results.plain_read_warm_mb_s,
      results.serialize_to_memory_mb_s, 100 * results.max_resident_after_drop);
}

absl::Status Run(const BenchOptions& options) {
  if (options.runs < 1) return absl::InvalidArgumentError("--runs: must be at least 1");
  if (options.hidden_size % 64 != 0) {
    return absl::InvalidArgumentError("--hidden: must be a multiple of 64");
  }
  std::cout << "checkpoint_bench: building the model and optimizer state\n" << std::flush;
  ASSIGN_OR_RETURN(TrainerState state, BuildTrainerState(options));

  ASSIGN_OR_RETURN(ScratchDir scratch, ScratchDir::Create(options.parent_dir));
  struct statvfs space;
  if (::statvfs(scratch.path().c_str(), &space) != 0) return ErrnoToStatus(errno, scratch.path());
  const double free_bytes = static_cast<double>(space.f_bavail) * space.f_frsize;
  if (free_bytes < kFreeSpaceFactor * state.state_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s: %.1f GB free, the benchmark needs %.1f GB (use --dir)", scratch.path(),
                        free_bytes / 1e9, kFreeSpaceFactor * state.state_bytes / 1e9));
  }

  Results results;
  results.state = &state;
  results.scratch = scratch.path();
  results.file_system = FileSystemType(scratch.path());
  std::cout << absl::StrFormat(
                   "checkpoint_bench: %d layers x %d, vocab %d: %.1fM parameters, %.1f MB of "
                   "weights + AdamW moments; %d runs in %s\n",
                   options.num_layers, options.hidden_size, options.vocab_size,
                   planner::CountParameters(state.summary.dims()) / 1e6,
                   state.state_bytes / kBytesPerMb, options.runs, scratch.path())
            << std::flush;
  results.load_average_before = LoadAverage();
  RETURN_IF_ERROR(RunIterations(options, results));
  results.load_average_after = LoadAverage();
  PrintSummary(results);
  return WriteResultsFile(options.results_dir, kResultsFileName,
                          ResultsJson(options, results).dump(2) + "\n");
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  using namespace tessera::bench;
  tessera::ParseCommandLine(
      argc, argv,
      "Usage: checkpoint_bench [--dir=DIR] [--runs=N] [--layers=N --hidden=N --vocab=N]\n\n"
      "Saves and loads a ~1 GB model + AdamW checkpoint with the trainer's checkpoint code and\n"
      "compares it with a plain sequential write and read of the same bytes in the same\n"
      "directory. Writes $TESSERA_BENCH_RESULTS/checkpoint.json.\n");
  BenchOptions options;
  options.parent_dir = absl::GetFlag(FLAGS_dir);
  if (options.parent_dir.empty()) options.parent_dir = EnvOr(kTmpDirEnv, "/tmp");
  options.runs = absl::GetFlag(FLAGS_runs);
  options.num_layers = absl::GetFlag(FLAGS_layers);
  options.hidden_size = absl::GetFlag(FLAGS_hidden);
  options.vocab_size = absl::GetFlag(FLAGS_vocab);
  options.verify_then_load = absl::GetFlag(FLAGS_verify_then_load);
  options.copy_before_step = absl::GetFlag(FLAGS_copy_before_step);
  options.results_dir = ResultsDir(ResultsBesideExecutable());
  const Provenance provenance = ReadProvenance();
  options.commit = provenance.commit;
  options.date = provenance.date;
  options.machine = provenance.machine;
  if (absl::Status status = Run(options); !status.ok()) {
    std::cerr << "checkpoint_bench: " << status << "\n";
    return 1;
  }
  return 0;
}
