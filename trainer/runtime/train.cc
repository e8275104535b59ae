#include "trainer/runtime/train.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "planner/devices.h"
#include "trainer/report/tensorboard_reports.h"
#include "trainer/runtime/run_builder.h"
#include "trainer/runtime/run_reporter.h"
#include "trainer/runtime/train_loop.h"
#include "trainer/runtime/training_run.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

v1::FailureKind ClassifyTorchError(const std::string& what) {
  if (absl::StrContains(what, "out of memory") || absl::StrContains(what, "OutOfMemory")) {
    return v1::FAILURE_KIND_OUT_OF_MEMORY;
  }
  // A collective whose peer went away (Gloo's TCP pairs; the pipeline's send/receive): the
  // consequence of another rank's failure, which that rank (or its worker) reports as the cause.
  // Gloo says which way it noticed: a read of 0 bytes, ECONNRESET, or EPIPE while it was writing.
  for (const char* lost : {"pipeline peer lost", "Connection closed by peer",
                           "Connection reset by peer", "Broken pipe", "Socket closed"}) {
    if (absl::StrContains(what, lost)) return v1::FAILURE_KIND_PEER_FAILED;
  }
  if (absl::StrContains(what, "Timed out") || absl::StrContains(what, "timed out") ||
      absl::StrContains(what, "Timeout") || absl::StrContains(what, "timeout")) {
    return v1::FAILURE_KIND_COLLECTIVE_TIMEOUT;
  }
  return v1::FAILURE_KIND_INTERNAL;
}

// After a failed collective: which ranks are gone. A collective error names at best a socket
// address, so every rank that survives one checks in on the job's store; the ranks that have
// not checked in after a few seconds are named (dead, or still blocked in a collective).
std::string LostRanks(const JoinedGroup& group, int rank, int world) {
  constexpr absl::Duration kGrace = absl::Seconds(5);
  try {
    const c10::intrusive_ptr<c10d::Store>& store = group.store;
    store->set(absl::StrCat("tessera/survived/", rank), std::vector<uint8_t>{1});
    std::vector<int> missing;
    const absl::Time deadline = absl::Now() + kGrace;
    do {
      missing.clear();
      for (int r = 0; r < world; ++r) {
        if (!store->check({absl::StrCat("tessera/survived/", r)})) missing.push_back(r);
      }
      if (missing.empty()) return "";
      absl::SleepFor(absl::Milliseconds(200));
    } while (absl::Now() < deadline);
    return absl::StrCat("; rank(s) ", absl::StrJoin(missing, ", "), " did not answer within ",
                        absl::FormatDuration(kGrace),
                        " of the failure (exited, or still blocked in a collective)");
  } catch (const std::exception& e) {
    return absl::StrCat("; the job's store (rank 0) is unreachable too: ",
                        c10::GetExceptionString(e));
  }
}

// Builds the run and trains it; LibTorch's and the data's exceptions are caught by the caller.
absl::Status BuildAndTrain(const v1::TrainerTask& task, const TrainOptions& options,
                           const RunReporter& reporter, TrainingRun& run,
                           std::optional<TrainLoop>& loop, v1::FailureKind* kind) {
  if (auto status = BuildTrainingRun(task, options, reporter, run, kind); !status.ok()) {
    return status;
  }
  loop.emplace(task, options, reporter, run);
  return loop->Run(kind);
}

// Rank 0's TensorBoard event file under <checkpoint directory>/tensorboard, with the spec and the
// plan as text; null for other ranks, without a checkpoint directory, or when it cannot be made
// (logged: TensorBoard is not worth failing a job for).
std::unique_ptr<TensorBoardWriter> OpenTensorBoard(const v1::TrainerTask& task, std::ostream* log) {
  if (task.assignment().rank() != 0 || task.checkpoint_directory().empty()) return nullptr;
  auto writer = TensorBoardWriter::Open(task.checkpoint_directory() + "/tensorboard");
  if (!writer.ok()) {
    if (log != nullptr) *log << "[rank 0] no TensorBoard events: " << writer.status() << std::endl;
    return nullptr;
  }
  WriteTaskText(task, 0, **writer);
  return *std::move(writer);
}

}  // namespace

double PeakFlopsForDevice(const std::string& device_name) {
  if (device_name.empty() || device_name == "cpu") return 0;
  auto device = planner::DeviceForGpuName(device_name, 0);
  return device.ok() ? device->peak_flops_bf16() : 0;
}

absl::StatusOr<TrainResult> RunTraining(const v1::TrainerTask& task, Reporter& reporter,
                                        const TrainOptions& options) {
  // Declared in this order so that each outlives what refers to it: the run's checkpointer
  // reports through `run_reporter` while it finishes a save, and the loop reads the run.
  std::unique_ptr<TensorBoardWriter> tensorboard = OpenTensorBoard(task, options.log);
  const RunReporter run_reporter(task, reporter, options.log, tensorboard.get());
  TrainingRun run;
  std::optional<TrainLoop> loop;
  absl::Status status;
  v1::FailureKind kind = v1::FAILURE_KIND_INTERNAL;
  try {
    status = BuildAndTrain(task, options, run_reporter, run, loop, &kind);
  } catch (const CorruptTokenError& e) {
    kind = v1::FAILURE_KIND_DATA_ERROR;
    status = absl::DataLossError(e.what());
  } catch (const c10::Error& e) {
    kind = ClassifyTorchError(e.what());
    status = absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    kind = ClassifyTorchError(e.what());
    status = absl::InternalError(e.what());
  }
  if (!status.ok()) {
    if ((kind == v1::FAILURE_KIND_COLLECTIVE_TIMEOUT || kind == v1::FAILURE_KIND_PEER_FAILED) &&
        run.group.has_value()) {
      status = absl::Status(
          status.code(),
          absl::StrCat(status.message(), LostRanks(*run.group, task.assignment().rank(),
                                                   task.assignment().world_size())));
    }
    // The step the failure happened after: the resumed one while the run was being built.
    run_reporter.ReportFailure(kind, loop.has_value() ? loop->step() : run.start_step, status);
    return status;
  }
  const TrainResult& result = loop->result();
  if (result.stopped) {
    run_reporter.Log(
        absl::StrCat("stopped at step ", result.final_step,
                     " after its checkpoint, as the worker asked (the job moves to other nodes)"));
    return result;
  }
  v1::TrainerReport report = run_reporter.NewReport();
  report.mutable_finished()->set_final_step(result.final_step);
  report.mutable_finished()->set_final_loss(result.final_loss);
  run_reporter.Send(report);
  return result;
}

}  // namespace tessera::trainer
