// Where a trainer's TrainerReports go: to its worker over a Unix socket as a
// stream of length-delimited protobufs (the typed channel), or, standalone,
// to stdout as one JSON object per line. The socket doubles as the trainer's
// lifeline: the worker never writes to it, so its closing means the worker is
// gone, and the trainer then ends itself rather than train on as an orphan.
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tessera/v1/trainer.pb.h"

namespace tessera::trainer {

// Thread safety: Send may be called from any thread.
class Reporter {
 public:
  virtual ~Reporter() = default;
  // Delivers one report. A lost worker connection is not the trainer's
  // failure: the report is dropped and the error returned for logging.
  virtual absl::Status Send(const v1::TrainerReport& report) = 0;
};

// One JSON object per line (proto3 JSON mapping, field names as in the .proto).
class JsonLinesReporter final : public Reporter {
 public:
  explicit JsonLinesReporter(std::ostream& out) : out_(out) {}
  absl::Status Send(const v1::TrainerReport& report) override;

 private:
  absl::Mutex mu_;
  std::ostream& out_ ABSL_GUARDED_BY(mu_);
};

// Logs "worker gone (report socket closed); exiting" to stderr and SIGKILLs
// the trainer's process group (itself and its data-loader helpers) when it
// leads one, else itself. Does not return.
[[noreturn]] void ExitBecauseWorkerGone();

struct SocketReporterOptions {
  // Called once, from the reporter's watch thread, when the worker closes its
  // end of the socket. Null: the socket is not watched. tessera-trainer
  // passes ExitBecauseWorkerGone.
  std::function<void()> on_worker_gone;
};

// Length-delimited (varint size prefix) TrainerReports over a connected Unix
// stream socket. A thread of its own watches the socket for the worker's
// hang-up (poll for POLLHUP/POLLRDHUP, or a read of 0 bytes) and runs
// options.on_worker_gone; the destructor stops that thread first.
class SocketReporter final : public Reporter {
 public:
  // UNAVAILABLE naming the path when nothing listens there.
  static absl::StatusOr<std::unique_ptr<SocketReporter>> Connect(
      const std::string& path, SocketReporterOptions options = {});
  ~SocketReporter() override;
  absl::Status Send(const v1::TrainerReport& report) override;

 private:
  SocketReporter(int fd, int wake_read, int wake_write);
  void Watch(std::function<void()> on_worker_gone);

  // The socket stays open until destruction (the watch thread polls it); a
  // failed send only marks it broken.
  const int fd_;
  // A pipe whose write end the destructor closes to wake the watch thread.
  const int wake_read_;
  const int wake_write_;
  std::thread watcher_;
  absl::Mutex mu_;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera::trainer
