// Token shard files: the tokenized training corpus as flat arrays of token ids, one file per
// shard, read through a read-only mmap so that many ranks on one node share the page cache.
//
// Format (little-endian): a 64-byte header
//   char magic[8] = "TSRSHRD1"; uint32 version (1 or 2); uint32 token_bytes (2 or 4);
//   uint64 num_tokens; uint32 vocab_size;
//   version 2 only: uint32 flags (bit 0: a loss mask follows the tokens; bit 1: record starts
//   follow the tokens and the mask); uint64 sample_tokens; zeros up to byte 64
// followed by num_tokens tokens of token_bytes each. Tokens are uint16 when vocab_size <= 65536,
// else uint32. With flag bit 0, num_tokens loss-mask bytes follow the tokens: byte i is 1 when
// token i counts as a training target (it is predicted from token i - 1 and its loss is taken),
// 0 when it does not (a prompt or padding token). sample_tokens, when not 0, says the shard is a
// sequence of fixed samples of that many tokens (seq_len + 1, as `prepare --seq_len` writes them)
// that a reader must cut at exactly that size. With flag bit 1, num_tokens more bytes follow: byte
// i is 1 when token i begins a record (a document or an example that `prepare --pack` put into a
// sample with others), else 0; training keeps a record's tokens from attending to other records'
// and counts positions from each record's start. A version-1 shard has neither: every token counts
// and windows may be cut anywhere. Writers write version 1 unless a mask or sample size is given,
// so that older readers keep reading plain corpora.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::trainer {

inline constexpr char kTokenShardMagic[8] = {'T', 'S', 'R', 'S', 'H', 'R', 'D', '1'};
// The newest version written; readers accept 1 and 2.
inline constexpr uint32_t kTokenShardVersion = 2;
inline constexpr size_t kTokenShardHeaderBytes = 64;
inline constexpr uint32_t kTokenShardHasLossMask = 1u << 0;
inline constexpr uint32_t kTokenShardHasRecordStarts = 1u << 1;

// Bytes per token in a shard of this vocabulary: 2 up to 65536 ids, else 4.
uint32_t TokenBytesForVocab(uint32_t vocab_size);

// Writes `tokens` as a shard at `path`: to `path`.tmp first, then renamed, so a reader never sees
// a half-written shard. INVALID_ARGUMENT when vocab_size is 0 or a token is >= vocab_size.
absl::Status WriteTokenShard(const std::string& path, std::span<const uint32_t> tokens,
                             uint32_t vocab_size);

// What a version-2 shard adds (see the format above).
struct TokenShardExtras {
  // Empty: no mask (every token counts). Else one entry per token, each 0 or 1.
  std::span<const uint8_t> loss_mask;
  // 0: none. Else num_tokens must be a multiple of it.
  uint64_t sample_tokens = 0;
  // Empty: none. Else one entry per token, each 0 or 1 (1: the token begins a record).
  std::span<const uint8_t> record_starts;
};

// As above, writing version 2 when `extras` holds a mask, record starts or a sample size, else
// version 1. INVALID_ARGUMENT also when the mask's or the record starts' length differs from the
// tokens', one of their bytes is not 0 or 1, or the tokens are not whole samples.
absl::Status WriteTokenShard(const std::string& path, std::span<const uint32_t> tokens,
                             uint32_t vocab_size, const TokenShardExtras& extras);

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
  uint32_t version() const { return version_; }
  // Whether the shard carries a loss mask (version 2 with the flag); without one every token
  // counts.
  bool has_loss_mask() const { return loss_mask_ != nullptr; }
  // The fixed sample size the shard was written in, or 0 (see the format above).
  uint64_t sample_tokens() const { return sample_tokens_; }

  // Token `i`; `i` < size().
  uint32_t token(uint64_t i) const;
  // Copies tokens [offset, offset + count) into `out`, widened to int64 (LibTorch's index type).
  // The range must lie inside the shard.
  void Read(uint64_t offset, uint64_t count, int64_t* out) const;
  // Copies the loss mask of tokens [offset, offset + count) into `out` (all 1 without a mask).
  void ReadLossMask(uint64_t offset, uint64_t count, uint8_t* out) const;
  // Whether the shard says where its records begin (version 2 with flag bit 1).
  bool has_record_starts() const { return record_starts_ != nullptr; }
  // Copies the record starts of tokens [offset, offset + count) into `out` (all 0 without them).
  void ReadRecordStarts(uint64_t offset, uint64_t count, uint8_t* out) const;

 private:
  TokenShard() = default;
  void Unmap();
  // Copies bytes [offset, offset + count) of a per-token section (the loss mask, the record
  // starts) into `out`, or `absent` for each when the shard has no such section.
  void ReadTokenBytes(const uint8_t* section, uint8_t absent, uint64_t offset, uint64_t count,
                      uint8_t* out) const;

  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  const uint8_t* loss_mask_ = nullptr;
  const uint8_t* record_starts_ = nullptr;
  uint64_t num_tokens_ = 0;
  uint32_t vocab_size_ = 0;
  uint32_t token_bytes_ = 0;
  uint32_t version_ = 0;
  uint64_t sample_tokens_ = 0;
};

}  // namespace tessera::trainer
