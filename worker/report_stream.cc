#include "worker/report_stream.h"

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"

namespace tessera::worker {

absl::Status ReadTrainerReport(google::protobuf::io::ZeroCopyInputStream* stream,
                               v1::TrainerReport* report) {
  report->Clear();
  // A CodedInputStream per frame: its destructor hands the unread rest of its buffer back to
  // `stream`, so the next call starts at the next frame.
  google::protobuf::io::CodedInputStream coded(stream);
  // No byte left: the trainer closed its end between frames.
  const void* next = nullptr;
  int buffered = 0;
  if (!coded.GetDirectBufferPointer(&next, &buffered)) {
    return absl::OutOfRangeError("report stream: end of stream");
  }
  uint32_t size = 0;
  if (!coded.ReadVarint32(&size)) {
    return absl::DataLossError("report stream: truncated or malformed size prefix");
  }
  if (size > kMaxTrainerReportBytes) {
    return absl::DataLossError(absl::StrCat(
        "report stream: frame of ", size, " bytes exceeds the limit of ", kMaxTrainerReportBytes));
  }
  const google::protobuf::io::CodedInputStream::Limit limit =
      coded.PushLimit(static_cast<int>(size));
  if (!report->ParseFromCodedStream(&coded) || coded.BytesUntilLimit() != 0) {
    return absl::DataLossError(
        absl::StrCat("report stream: frame of ", size, " bytes is not a TrainerReport"));
  }
  coded.PopLimit(limit);
  return absl::OkStatus();
}

}  // namespace tessera::worker
