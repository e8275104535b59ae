// SealedMemory: bytes in an anonymous memory file (memfd) sealed against every change, with a
// read-only mapping of them. The worker's shard cache keeps checkpoint shards in these and hands
// the descriptor to its trainers over the local socket (common/socket_frames.h), so a restore
// maps the worker's pages instead of copying them through the socket: the receiver can read the
// bytes, never change them (the seals hold for every process). Thread safety: immutable once
// made; move-only.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera {

class SealedMemory {
 public:
  // No bytes, no descriptor.
  SealedMemory() = default;
  SealedMemory(SealedMemory&& other) noexcept;
  SealedMemory& operator=(SealedMemory&& other) noexcept;
  SealedMemory(const SealedMemory&) = delete;
  SealedMemory& operator=(const SealedMemory&) = delete;
  ~SealedMemory();

  // A memory file of `size` bytes (named `name` in /proc/<pid>/fd, for debugging) that `fill`
  // writes through a writable mapping before the seals go on; fill's error is returned as it is.
  // RESOURCE_EXHAUSTED when the memory cannot be had.
  static absl::StatusOr<SealedMemory> Create(const char* name, size_t size,
                                             absl::FunctionRef<absl::Status(char* data)> fill);
  // Create filled with a copy of `bytes`.
  static absl::StatusOr<SealedMemory> Copy(const char* name, std::string_view bytes);

  // A memory file filled piece by piece (a stream's chunks as they come in), then sealed: Start
  // makes it, with a writable mapping of its `size` bytes; data() is written by one thread at a
  // time; Seal drops the writable mapping, seals the file and maps it read-only. A writer
  // destroyed unsealed discards the file. RESOURCE_EXHAUSTED when the memory cannot be had.
  class Writer {
   public:
    static absl::StatusOr<Writer> Start(const char* name, size_t size);
    Writer(Writer&& other) noexcept;
    Writer& operator=(Writer&& other) noexcept;
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;
    ~Writer();

    // Null for 0 bytes.
    char* data() { return writable_; }
    size_t size() const { return size_; }
    absl::StatusOr<SealedMemory> Seal() &&;

   private:
    Writer(std::string name, int fd, char* writable, size_t size)
        : name_(std::move(name)), fd_(fd), writable_(writable), size_(size) {}
    void Reset();

    std::string name_;
    int fd_ = -1;
    char* writable_ = nullptr;
    size_t size_ = 0;
  };
  // A memory file holding the first `size` bytes of the open file `file_fd` (from its offset 0),
  // copied by the kernel (sendfile) without mapping the pages here; the mapping is made without
  // touching them (a process that only passes the descriptor on never faults them in).
  // DATA_LOSS when the file holds fewer bytes; RESOURCE_EXHAUSTED when the memory cannot be had.
  static absl::StatusOr<SealedMemory> CopyOfFile(const char* name, int file_fd, size_t size);
  // Takes ownership of `fd` (received from another process) and maps it read-only.
  // FAILED_PRECONDITION (and `fd` closed) unless it is a memory file sealed against writes,
  // growth and shrinking: bytes another process can still change are not taken.
  static absl::StatusOr<SealedMemory> Adopt(int fd);

  std::string_view view() const { return {data(), size_}; }
  // Never null ("" when empty).
  const char* data() const { return data_ != nullptr ? data_ : ""; }
  size_t size() const { return size_; }
  // The memory file's descriptor (-1 when empty-constructed), to pass to another process.
  int fd() const { return fd_; }
  // A path that opens the same bytes read-only in this process (/proc/self/fd/<fd>).
  std::string ProcPath() const;

 private:
  SealedMemory(int fd, const char* data, size_t size) : fd_(fd), data_(data), size_(size) {}
  void Reset();

  int fd_ = -1;
  const char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace tessera
