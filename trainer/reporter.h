// Where a trainer's TrainerReports go: to its worker over a Unix socket as a
// stream of length-delimited protobufs (the typed channel), or, standalone,
// to stdout as one JSON object per line.
#pragma once

#include <memory>
#include <ostream>
#include <string>

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

// Length-delimited (varint size prefix) TrainerReports over a connected Unix
// stream socket.
class SocketReporter final : public Reporter {
 public:
  // UNAVAILABLE naming the path when nothing listens there.
  static absl::StatusOr<std::unique_ptr<SocketReporter>> Connect(const std::string& path);
  ~SocketReporter() override;
  absl::Status Send(const v1::TrainerReport& report) override;

 private:
  explicit SocketReporter(int fd) : fd_(fd) {}
  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::trainer
