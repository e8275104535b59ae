// The reading side of a trainer's report channel (trainer/report/reporter.h writes it): a stream of
// tessera.v1.TrainerReport messages, each prefixed with its size in bytes as a varint32. The
// bytes come from a trainer process, i.e. from the job's code and data, so the reader trusts
// nothing in them: a frame is bounded, and a malformed one ends the stream.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "tessera/v1/trainer.pb.h"

namespace tessera::worker {

// Largest report frame a worker accepts. Reports carry metrics, events and failure messages with
// a log tail: kilobytes. A larger size prefix is a corrupt or hostile stream.
inline constexpr uint32_t kMaxTrainerReportBytes = 16 << 20;

// Reads the next frame of `stream` into `report` (cleared first). OUT_OF_RANGE at the end of the
// stream before a frame's first byte; DATA_LOSS for a truncated frame, a size above
// kMaxTrainerReportBytes, or bytes that are not exactly one TrainerReport of that size. After an
// error the stream's position is unspecified: the caller drops the connection.
absl::Status ReadTrainerReport(google::protobuf::io::ZeroCopyInputStream* stream,
                               v1::TrainerReport* report);

}  // namespace tessera::worker
