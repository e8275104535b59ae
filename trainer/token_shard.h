// Token shard files: the tokenized training corpus as flat arrays of token ids, one file per
// shard, read through a read-only mmap so that many ranks on one node share the page cache.
//
// Format (little-endian): a 64-byte header
//   char magic[8] = "TSRSHRD1"; uint32 version = 1; uint32 token_bytes (2 or 4);
//   uint64 num_tokens; uint32 vocab_size; zeros up to byte 64
// followed by num_tokens tokens of token_bytes each. Tokens are uint16 when vocab_size <= 65536,
// else uint32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::trainer {

inline constexpr char kTokenShardMagic[8] = {'T', 'S', 'R', 'S', 'H', 'R', 'D', '1'};
inline constexpr uint32_t kTokenShardVersion = 1;
inline constexpr size_t kTokenShardHeaderBytes = 64;

// Bytes per token in a shard of this vocabulary: 2 up to 65536 ids, else 4.
uint32_t TokenBytesForVocab(uint32_t vocab_size);

// Writes `tokens` as a shard at `path`: to `path`.tmp first, then renamed, so a reader never sees
// a half-written shard. INVALID_ARGUMENT when vocab_size is 0 or a token is >= vocab_size.
absl::Status WriteTokenShard(const std::string& path, std::span<const uint32_t> tokens,
                             uint32_t vocab_size);

// A shard opened read-only. Movable, not copyable; unmaps in the destructor. Reads are const and
// safe from several threads.
class TokenShard {
 public:
  // NOT_FOUND when `path` does not exist; DATA_LOSS for a bad magic, version or token width, or a
  // file size that does not match the header. Every message names the file.
  static absl::StatusOr<TokenShard> Open(const std::string& path);

  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  const std::string& path() const { return path_; }
  // Number of tokens.
  uint64_t size() const { return num_tokens_; }
  uint32_t vocab_size() const { return vocab_size_; }
  uint32_t token_bytes() const { return token_bytes_; }

  // Token `i`; `i` < size().
  uint32_t token(uint64_t i) const;
  // Copies tokens [offset, offset + count) into `out`, widened to int64 (LibTorch's index type).
  // The range must lie inside the shard.
  void Read(uint64_t offset, uint64_t count, int64_t* out) const;

 private:
  TokenShard() = default;
  void Unmap();

  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  uint64_t num_tokens_ = 0;
  uint32_t vocab_size_ = 0;
  uint32_t token_bytes_ = 0;
};

}  // namespace tessera::trainer
