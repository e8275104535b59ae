// TensorBoard event files written by a trainer rank, so that `tensorboard --logdir` pointed at a
// job's checkpoint directory shows its curves next to its checkpoints, as HF Trainer and
// torchtitan users expect.
//
// Format (TensorBoard's documented one): a TFRecord file named
// events.out.tfevents.<unix seconds>.<host>.<pid>.<suffix>, each record
//   uint64 length (little-endian) | uint32 masked CRC32C of the length bytes |
//   data (a serialized tensorboard Event) | uint32 masked CRC32C of the data
// where mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. The first event carries the file
// version "brain.Event:2"; the others hold scalar summaries (simple_value) or text summaries (a
// string tensor with the "text" plugin's metadata). CRC32C comes from ISA-L.
//
// Events are buffered and written by Flush (at most every flush_interval from Add*, and on
// Close/destruction), so a step costs no system call; a crash loses at most that interval.
//
// Thread safety: all methods may be called from several threads (the loop and the
// checkpointer's thread both report).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessera::trainer {

// CRC32C (Castagnoli) of `data`, and TFRecord's masked form of a CRC.
uint32_t Crc32c(std::string_view data);
uint32_t MaskCrc32c(uint32_t crc);

// One TFRecord record around `data`.
std::string TfRecord(std::string_view data);

struct TensorBoardWriterOptions {
  // Write buffered events at least this often.
  absl::Duration flush_interval = absl::Seconds(10);
  // The wall clock of events (tests fix it).
  absl::Time (*now)() = &absl::Now;
  // Appended to the file name, e.g. ".rank0", so several writers can share a directory.
  std::string file_suffix;
};

class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) and a new event file in it, with the file-version event.
  static absl::StatusOr<std::unique_ptr<TensorBoardWriter>> Open(
      const std::string& dir, TensorBoardWriterOptions options = {});
  ~TensorBoardWriter();

  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  const std::string& path() const { return path_; }

  // A scalar `tag` = `value` at `step`.
  void AddScalar(std::string_view tag, int64_t step, double value) ABSL_LOCKS_EXCLUDED(mu_);
  // A text summary (markdown, as TensorBoard's text dashboard renders it).
  void AddText(std::string_view tag, int64_t step, std::string_view text)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Writes and flushes what is buffered. The first error is kept and returned from then on;
  // later events are dropped (a full disk must not stop training).
  absl::Status Flush() ABSL_LOCKS_EXCLUDED(mu_);
  // Flush, then close the file.
  absl::Status Close() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  TensorBoardWriter(std::string path, std::FILE* file, TensorBoardWriterOptions options);
  void Append(const std::string& event) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes and flushes pending_, keeping the first failure in error_.
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const TensorBoardWriterOptions options_;
  absl::Mutex mu_;
  std::FILE* file_ ABSL_GUARDED_BY(mu_);
  std::string pending_ ABSL_GUARDED_BY(mu_);
  absl::Time last_flush_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::trainer
