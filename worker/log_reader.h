// LogReader: reads one trainer rank's log file incrementally, from its start or from the start of
// its last N lines, for Worker.ReadLogs (including `follow`, by calling ReadMore again as the file
// grows) and for failure messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace tessera::worker {

// An open log file and a byte offset into it. The file stays open, so a reader keeps following
// it if it is renamed; a file truncated below the offset is read again from its start.
// Thread safety: one thread at a time. Movable, not copyable.
class LogReader {
 public:
  // Opens `path`; `tail_lines` > 0 starts at the beginning of its last `tail_lines` lines (a final
  // line without '\n' counts as a line), else at its start. NOT_FOUND naming the path when it does
  // not exist.
  static absl::StatusOr<LogReader> Open(const std::string& path, int tail_lines);

  LogReader(LogReader&& other) noexcept;
  LogReader& operator=(LogReader&& other) noexcept;
  LogReader(const LogReader&) = delete;
  LogReader& operator=(const LogReader&) = delete;
  ~LogReader();

  // Up to `max_bytes` of data past offset() (empty when there is nothing new); offset() advances
  // by the size returned. Never blocks waiting for data.
  absl::StatusOr<std::string> ReadMore(size_t max_bytes);

  // Byte offset in the file of the next byte ReadMore returns.
  int64_t offset() const { return offset_; }
  const std::string& path() const { return path_; }

 private:
  LogReader(int fd, std::string path, int64_t offset)
      : fd_(fd), path_(std::move(path)), offset_(offset) {}

  int fd_ = -1;
  std::string path_;
  int64_t offset_ = 0;
};

// The offset at which the last `lines` lines of the open file `fd` (of `size` bytes) start; 0 when
// it has no more lines than that.
absl::StatusOr<int64_t> TailOffset(int fd, int64_t size, int lines);

}  // namespace tessera::worker
