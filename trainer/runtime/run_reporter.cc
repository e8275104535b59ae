#include "trainer/runtime/run_reporter.h"

#include "absl/strings/str_cat.h"
#include "common/timestamp.h"
#include "trainer/report/tensorboard_reports.h"

namespace tessera::trainer {

RunReporter::RunReporter(const v1::TrainerTask& task, Reporter& reporter, std::ostream* log,
                         TensorBoardWriter* tensorboard)
    : task_(task), reporter_(reporter), log_(log), tensorboard_(tensorboard) {}

void RunReporter::Log(const std::string& line) const {
  if (log_ != nullptr) *log_ << "[rank " << rank() << "] " << line << std::endl;
}

v1::TrainerReport RunReporter::NewReport() const {
  v1::TrainerReport report;
  report.set_job_id(task_.job_id());
  report.set_attempt(task_.attempt());
  report.set_rank(rank());
  *report.mutable_time() = NowTimestamp();
  return report;
}

void RunReporter::SendToWorkerOnly(const v1::TrainerReport& report) const {
  if (auto status = reporter_.Send(report); !status.ok()) {
    Log(absl::StrCat("report not delivered: ", status.ToString()));
  }
}

void RunReporter::Send(const v1::TrainerReport& report) const {
  SendToWorkerOnly(report);
  if (tensorboard_ == nullptr) return;
  WriteToTensorBoard(report, *tensorboard_);
  if (report.has_finished() || report.has_failure()) {
    // The writer keeps its first error and returns it from every flush: logged once, here.
    if (auto status = tensorboard_->Flush(); !status.ok()) {
      Log(absl::StrCat("TensorBoard events not written: ", status.ToString()));
    }
  }
}

void RunReporter::ReportFailure(v1::FailureKind kind, int64_t step,
                                const absl::Status& status) const {
  v1::TrainerReport report = NewReport();
  v1::TrainerFailure* failure = report.mutable_failure();
  failure->set_kind(kind);
  failure->set_rank(rank());
  failure->set_step(step);
  failure->set_message(std::string(status.message()));
  // The worker blames the first failure of a task by this time.
  *failure->mutable_time() = report.time();
  Send(report);
  Log(absl::StrCat("failed: ", status.ToString()));
}

}  // namespace tessera::trainer
