// Fuzz target: the worker's reader of a trainer's report stream (worker/report_stream.h). The
// first input byte picks the stream's block size, so frames split across buffers at every
// place; the rest is the stream.
#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "tests/fuzz/contract.h"
#include "tests/fuzz/protobuf_logs.h"
#include "worker/report_stream.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  tessera::fuzz::SilenceProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int block_size = 1 + data[0] % 64;
  const int stream_bytes = static_cast<int>(size - 1);
  google::protobuf::io::ArrayInputStream stream(data + 1, stream_bytes, block_size);
  tessera::v1::TrainerReport report;
  absl::Status status;
  // Every frame takes at least its one-byte size prefix, so this ends.
  do {
    status = tessera::worker::ReadTrainerReport(&stream, &report);
  } while (status.ok());
  // The end of the stream is reported only at its end, never inside a frame.
  if (status.code() == absl::StatusCode::kOutOfRange && stream.ByteCount() != stream_bytes) {
    tessera::fuzz::ContractBroken(
        absl::StrCat("OUT_OF_RANGE after ", stream.ByteCount(), " of ", stream_bytes, " bytes"));
  }
  return 0;
}
