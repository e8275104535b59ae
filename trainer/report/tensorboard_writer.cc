#include "trainer/report/tensorboard_writer.h"

#include <isa-l/crc.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/base/internal/endian.h"
#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "trainer/report/tensorboard_event.pb.h"

namespace tessera::trainer {
namespace {

constexpr uint32_t kMaskDelta = 0xa282ead8u;

std::string Serialize(const tensorboard::Event& event) {
  std::string out;
  event.SerializeToString(&out);
  return out;
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  // ISA-L's crc32_iscsi neither pre- nor post-inverts: the standard CRC32C starts from all ones
  // and inverts the result.
  return crc32_iscsi(reinterpret_cast<unsigned char*>(const_cast<char*>(data.data())),
                     static_cast<int>(data.size()), 0xffffffffu) ^
         0xffffffffu;
}

uint32_t MaskCrc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + kMaskDelta; }

std::string TfRecord(std::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  char length[8];
  absl::little_endian::Store64(length, data.size());
  char crc[4];
  record.append(length, sizeof(length));
  absl::little_endian::Store32(crc, MaskCrc32c(Crc32c(std::string_view(length, sizeof(length)))));
  record.append(crc, sizeof(crc));
  record.append(data);
  absl::little_endian::Store32(crc, MaskCrc32c(Crc32c(data)));
  record.append(crc, sizeof(crc));
  return record;
}

absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::Open(
    const std::string& dir, TensorBoardWriterOptions options) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the TensorBoard directory ", dir, ": ", ec.message()));
  }
  // Several writers in one process (tests) get distinct names from the counter.
  static std::atomic<int> opened{0};
  const absl::Time now = options.now();
  const std::string path =
      absl::StrCat(dir, "/events.out.tfevents.", absl::ToUnixSeconds(now), ".", HostName(), ".",
                   getpid(), ".", opened.fetch_add(1), options.file_suffix);
  std::FILE* file = std::fopen(path.c_str(), "wbx");
  if (file == nullptr) {
    return ErrnoToStatus(errno, absl::StrCat("creating the TensorBoard event file ", path));
  }
  std::unique_ptr<TensorBoardWriter> writer(new TensorBoardWriter(path, file, std::move(options)));
  tensorboard::Event version;
  version.set_wall_time(absl::ToDoubleSeconds(now - absl::UnixEpoch()));
  version.set_file_version("brain.Event:2");
  writer->Append(Serialize(version));
  if (absl::Status flushed = writer->Flush(); !flushed.ok()) return flushed;
  return writer;
}

TensorBoardWriter::TensorBoardWriter(std::string path, std::FILE* file,
                                     TensorBoardWriterOptions options)
    : path_(std::move(path)), options_(std::move(options)), file_(file) {
  last_flush_ = options_.now();
}

TensorBoardWriter::~TensorBoardWriter() {
  // An error was returned to Flush's callers already; nobody is left to tell here.
  Close().IgnoreError();
}

void TensorBoardWriter::AddScalar(std::string_view tag, int64_t step, double value) {
  tensorboard::Event event;
  event.set_wall_time(absl::ToDoubleSeconds(options_.now() - absl::UnixEpoch()));
  event.set_step(step);
  tensorboard::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(std::string(tag));
  v->set_simple_value(static_cast<float>(value));
  Append(Serialize(event));
}

void TensorBoardWriter::AddText(std::string_view tag, int64_t step, std::string_view text) {
  tensorboard::Event event;
  event.set_wall_time(absl::ToDoubleSeconds(options_.now() - absl::UnixEpoch()));
  event.set_step(step);
  tensorboard::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(std::string(tag));
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  tensorboard::TensorProto* tensor = v->mutable_tensor();
  tensor->set_dtype(tensorboard::DT_STRING);
  tensor->mutable_tensor_shape();  // a scalar string: a shape with no dimensions
  tensor->add_string_val(std::string(text));
  Append(Serialize(event));
}

void TensorBoardWriter::Append(const std::string& event) {
  absl::MutexLock lock(&mu_);
  if (file_ == nullptr || !error_.ok()) return;
  pending_ += TfRecord(event);
  // A failure is kept in error_ and returned by the next Flush.
  if (options_.now() - last_flush_ >= options_.flush_interval) WriteLocked();
}

absl::Status TensorBoardWriter::Flush() {
  absl::MutexLock lock(&mu_);
  WriteLocked();
  return error_;
}

void TensorBoardWriter::WriteLocked() {
  if (!error_.ok() || file_ == nullptr) return;
  last_flush_ = options_.now();
  if (!pending_.empty() &&
      std::fwrite(pending_.data(), 1, pending_.size(), file_) != pending_.size()) {
    error_ = ErrnoToStatus(errno, absl::StrCat("writing ", path_));
  } else if (std::fflush(file_) != 0) {
    error_ = ErrnoToStatus(errno, absl::StrCat("flushing ", path_));
  }
  pending_.clear();
}

absl::Status TensorBoardWriter::Close() {
  absl::MutexLock lock(&mu_);
  if (file_ == nullptr) return error_;
  WriteLocked();
  if (std::fclose(file_) != 0 && error_.ok()) {
    error_ = ErrnoToStatus(errno, absl::StrCat("closing ", path_));
  }
  file_ = nullptr;
  return error_;
}

}  // namespace tessera::trainer
