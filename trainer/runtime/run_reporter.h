// What one rank of a run says: reports to its worker (report/reporter.h), stamped with the job,
// attempt, rank and time, and progress lines to the log. Shared by the run's builder and its loop.
//
// Thread safety: no state of its own beyond its references. Send is also called from the
// checkpointer's background thread (rank 0's report of a commit nobody waits for), so the
// Reporter underneath sees the calls of two threads.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/report/reporter.h"
#include "trainer/report/tensorboard_writer.h"

namespace tessera::trainer {

class RunReporter {
 public:
  // `log` may be null (no progress lines); `tensorboard` may be null (no event files): when set,
  // every report sent also goes there (tensorboard_reports.h). `task`, `reporter` and
  // `tensorboard` must outlive this.
  RunReporter(const v1::TrainerTask& task, Reporter& reporter, std::ostream* log,
              TensorBoardWriter* tensorboard = nullptr);

  int rank() const { return task_.assignment().rank(); }

  // "[rank N] <line>" to the log.
  void Log(const std::string& line) const;
  // A report with the job, attempt, rank and the time now filled in.
  v1::TrainerReport NewReport() const;
  // Sends `report` (and writes it to TensorBoard; a finished or failed run's events are flushed
  // there); a report that cannot be delivered or written is logged, not returned.
  void Send(const v1::TrainerReport& report) const;
  // Sends `report` to the worker only: a step's metrics reported again from a checkpoint
  // (step_metrics_log.h), which the event file already holds (an out-of-order step there would
  // make TensorBoard drop the later ones).
  void SendToWorkerOnly(const v1::TrainerReport& report) const;
  // Reports the failure of this rank at `step` (stamped with the time it was reported, by which
  // the worker blames the first failure of a task) and logs it.
  void ReportFailure(v1::FailureKind kind, int64_t step, const absl::Status& status) const;

 private:
  const v1::TrainerTask& task_;
  Reporter& reporter_;
  std::ostream* log_;
  TensorBoardWriter* tensorboard_;
};

}  // namespace tessera::trainer
