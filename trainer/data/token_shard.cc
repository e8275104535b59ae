#include "trainer/data/token_shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"

namespace tessera::trainer {
namespace {

static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian and read in place");

struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;
  uint64_t num_tokens;
  uint32_t vocab_size;
  // Version 2 (zero in version 1).
  uint32_t flags;
  uint64_t sample_tokens;
  char reserved[24];
};
static_assert(sizeof(ShardHeader) == kTokenShardHeaderBytes);

std::string ErrnoMessage(int error) { return std::strerror(error); }

absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat(path, ": write failed: ", ErrnoMessage(errno)));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status WriteTokens(int fd, std::span<const uint32_t> tokens, const std::string& path) {
  constexpr size_t kChunk = 1 << 16;
  std::vector<T> buffer;
  buffer.reserve(std::min(kChunk, tokens.size()));
  for (size_t begin = 0; begin < tokens.size(); begin += kChunk) {
    const size_t end = std::min(tokens.size(), begin + kChunk);
    buffer.assign(tokens.begin() + begin, tokens.begin() + end);
    if (absl::Status s = WriteAll(fd, buffer.data(), buffer.size() * sizeof(T), path); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// A per-token byte array of TokenShardExtras (`what`: "loss mask", "record starts"): empty, or one
// entry per token, each 0 or 1.
absl::Status CheckTokenBytes(const std::string& path, absl::string_view what,
                             std::span<const uint8_t> bytes, size_t tokens) {
  if (!bytes.empty() && bytes.size() != tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", what, ": ", bytes.size(), " entries for ", tokens, " tokens"));
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", what, ": entry ", i, " is ", bytes[i], " (expected 0 or 1)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

uint32_t TokenBytesForVocab(uint32_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

absl::Status WriteTokenShard(const std::string& path, std::span<const uint32_t> tokens,
                             uint32_t vocab_size) {
  return WriteTokenShard(path, tokens, vocab_size, TokenShardExtras{});
}

absl::Status WriteTokenShard(const std::string& path, std::span<const uint32_t> tokens,
                             uint32_t vocab_size, const TokenShardExtras& extras) {
  RETURN_IF_ERROR(CheckTokenBytes(path, "loss mask", extras.loss_mask, tokens.size()));
  RETURN_IF_ERROR(CheckTokenBytes(path, "record starts", extras.record_starts, tokens.size()));
  if (extras.sample_tokens > 0 && tokens.size() % extras.sample_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", tokens.size(),
                                                   " tokens are not whole samples of ",
                                                   extras.sample_tokens));
  }
  if (vocab_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": vocab_size must be positive"));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": token ", i, " is ", tokens[i],
                                                     ", outside the vocabulary of ", vocab_size));
    }
  }
  ShardHeader header{};
  std::memcpy(header.magic, kTokenShardMagic, sizeof(header.magic));
  const bool version2 =
      !extras.loss_mask.empty() || !extras.record_starts.empty() || extras.sample_tokens > 0;
  header.version = version2 ? 2 : 1;
  header.flags = (!extras.loss_mask.empty() ? kTokenShardHasLossMask : 0) |
                 (!extras.record_starts.empty() ? kTokenShardHasRecordStarts : 0);
  header.sample_tokens = extras.sample_tokens;
  header.token_bytes = TokenBytesForVocab(vocab_size);
  header.num_tokens = tokens.size();
  header.vocab_size = vocab_size;

  const std::string tmp_path = path + ".tmp";
  const int fd = open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int error = errno;
    return absl::InternalError(absl::StrCat(tmp_path, ": cannot create: ", ErrnoMessage(error)));
  }
  ScopedFd closer(fd);
  absl::Status status = WriteAll(fd, &header, sizeof(header), tmp_path);
  if (status.ok()) {
    status = header.token_bytes == 2 ? WriteTokens<uint16_t>(fd, tokens, tmp_path)
                                     : WriteTokens<uint32_t>(fd, tokens, tmp_path);
  }
  if (status.ok() && !extras.loss_mask.empty()) {
    status = WriteAll(fd, extras.loss_mask.data(), extras.loss_mask.size(), tmp_path);
  }
  if (status.ok() && !extras.record_starts.empty()) {
    status = WriteAll(fd, extras.record_starts.data(), extras.record_starts.size(), tmp_path);
  }
  if (status.ok() && fsync(fd) != 0) {
    status = absl::InternalError(absl::StrCat(tmp_path, ": fsync failed: ", ErrnoMessage(errno)));
  }
  if (status.ok() && !closer.Close()) {
    status = absl::InternalError(absl::StrCat(tmp_path, ": close failed: ", ErrnoMessage(errno)));
  }
  if (status.ok() && std::rename(tmp_path.c_str(), path.c_str()) != 0) {
    status = absl::InternalError(
        absl::StrCat("cannot rename ", tmp_path, " to ", path, ": ", ErrnoMessage(errno)));
  }
  if (!status.ok()) unlink(tmp_path.c_str());
  return status;
}

absl::StatusOr<TokenShard> TokenShard::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such token shard"));
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open: ", ErrnoMessage(error)));
  }
  ScopedFd closer(fd);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot stat: ", ErrnoMessage(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kTokenShardHeaderBytes) {
    return absl::DataLossError(absl::StrCat(path, ": truncated: ", file_bytes,
                                            " bytes is shorter than the 64-byte shard header"));
  }
  void* mapping = mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (mapping == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(path, ": mmap failed: ", ErrnoMessage(errno)));
  }
  TokenShard shard;
  shard.path_ = path;
  shard.mapping_ = mapping;
  shard.mapping_bytes_ = file_bytes;

  ShardHeader header;
  std::memcpy(&header, mapping, sizeof(header));
  if (std::memcmp(header.magic, kTokenShardMagic, sizeof(header.magic)) != 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a token shard (bad magic; expected \"TSRSHRD1\")"));
  }
  if (header.version != 1 && header.version != 2) {
    return absl::DataLossError(absl::StrCat(path, ": unsupported token shard version ",
                                            header.version, " (this build reads versions 1 to ",
                                            kTokenShardVersion, ")"));
  }
  if (header.version == 1) {
    // Version 1 left these bytes reserved (written as zeros); never read meaning into them.
    header.flags = 0;
    header.sample_tokens = 0;
  } else if ((header.flags & ~(kTokenShardHasLossMask | kTokenShardHasRecordStarts)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": unknown token shard flags 0x",
                                            absl::Hex(header.flags),
                                            " (written by a newer build?)"));
  }
  const uint64_t mask_bytes_per_token = (header.flags & kTokenShardHasLossMask) ? 1 : 0;
  const uint64_t start_bytes_per_token = (header.flags & kTokenShardHasRecordStarts) ? 1 : 0;
  if (header.token_bytes != 2 && header.token_bytes != 4) {
    return absl::DataLossError(
        absl::StrCat(path, ": bad token width ", header.token_bytes, " bytes (expected 2 or 4)"));
  }
  if (header.vocab_size == 0 || header.token_bytes != TokenBytesForVocab(header.vocab_size)) {
    return absl::DataLossError(absl::StrCat(path, ": token width ", header.token_bytes,
                                            " bytes does not fit vocab_size ", header.vocab_size));
  }
  const uint64_t bytes_per_token =
      header.token_bytes + mask_bytes_per_token + start_bytes_per_token;
  const uint64_t max_tokens = (UINT64_MAX - kTokenShardHeaderBytes) / bytes_per_token;
  if (header.num_tokens > max_tokens ||
      kTokenShardHeaderBytes + header.num_tokens * bytes_per_token != file_bytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": truncated: header says ", header.num_tokens, " tokens",
                     mask_bytes_per_token ? " with a loss mask" : "",
                     start_bytes_per_token ? " with record starts" : "", " (",
                     kTokenShardHeaderBytes + header.num_tokens * bytes_per_token,
                     " bytes) but the file has ", file_bytes, " bytes"));
  }
  if (header.sample_tokens > 0 && header.num_tokens % header.sample_tokens != 0) {
    return absl::DataLossError(absl::StrCat(path, ": ", header.num_tokens,
                                            " tokens are not whole samples of ",
                                            header.sample_tokens));
  }
  // Training reads windows in a random order; say so to the kernel.
  madvise(mapping, file_bytes, MADV_RANDOM);
  shard.tokens_ = static_cast<const unsigned char*>(mapping) + kTokenShardHeaderBytes;
  shard.num_tokens_ = header.num_tokens;
  shard.vocab_size_ = header.vocab_size;
  shard.token_bytes_ = header.token_bytes;
  shard.version_ = header.version;
  shard.sample_tokens_ = header.sample_tokens;
  if (mask_bytes_per_token) {
    shard.loss_mask_ = shard.tokens_ + header.num_tokens * header.token_bytes;
  }
  if (start_bytes_per_token) {
    shard.record_starts_ =
        shard.tokens_ + header.num_tokens * (header.token_bytes + mask_bytes_per_token);
  }
  return shard;
}

TokenShard::TokenShard(TokenShard&& other) noexcept { *this = std::move(other); }

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_bytes_ = std::exchange(other.mapping_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    loss_mask_ = std::exchange(other.loss_mask_, nullptr);
    record_starts_ = std::exchange(other.record_starts_, nullptr);
    num_tokens_ = std::exchange(other.num_tokens_, 0);
    vocab_size_ = std::exchange(other.vocab_size_, 0);
    token_bytes_ = std::exchange(other.token_bytes_, 0);
    version_ = std::exchange(other.version_, 0);
    sample_tokens_ = std::exchange(other.sample_tokens_, 0);
  }
  return *this;
}

TokenShard::~TokenShard() { Unmap(); }

void TokenShard::Unmap() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
  mapping_ = nullptr;
  mapping_bytes_ = 0;
  tokens_ = nullptr;
  loss_mask_ = nullptr;
  record_starts_ = nullptr;
}

uint32_t TokenShard::token(uint64_t i) const {
  assert(i < num_tokens_);
  if (token_bytes_ == 2) {
    uint16_t value;
    std::memcpy(&value, tokens_ + i * 2, 2);
    return value;
  }
  uint32_t value;
  std::memcpy(&value, tokens_ + i * 4, 4);
  return value;
}

namespace {

void CheckRange(const std::string& path, uint64_t offset, uint64_t count, uint64_t num_tokens) {
  if (offset > num_tokens || count > num_tokens - offset) {
    // A caller bug, not a data problem: the dataset computes every range from the header.
    std::fprintf(stderr, "%s: read of %llu tokens at %llu past the %llu tokens of the shard\n",
                 path.c_str(), static_cast<unsigned long long>(count),
                 static_cast<unsigned long long>(offset),
                 static_cast<unsigned long long>(num_tokens));
    std::abort();
  }
}

}  // namespace

void TokenShard::ReadLossMask(uint64_t offset, uint64_t count, uint8_t* out) const {
  ReadTokenBytes(loss_mask_, /*absent=*/1, offset, count, out);
}

void TokenShard::ReadRecordStarts(uint64_t offset, uint64_t count, uint8_t* out) const {
  ReadTokenBytes(record_starts_, /*absent=*/0, offset, count, out);
}

void TokenShard::ReadTokenBytes(const uint8_t* section, uint8_t absent, uint64_t offset,
                                uint64_t count, uint8_t* out) const {
  CheckRange(path_, offset, count, num_tokens_);
  if (count == 0) return;  // `out` may be null then (an empty vector's data())
  if (section == nullptr) {
    std::memset(out, absent, count);
  } else {
    std::memcpy(out, section + offset, count);
  }
}

void TokenShard::Read(uint64_t offset, uint64_t count, int64_t* out) const {
  if (offset > num_tokens_ || count > num_tokens_ - offset) {
    // A caller bug, not a data problem: the dataset computes every range from the header.
    std::fprintf(stderr, "%s: read of %llu tokens at %llu past the %llu tokens of the shard\n",
                 path_.c_str(), static_cast<unsigned long long>(count),
                 static_cast<unsigned long long>(offset),
                 static_cast<unsigned long long>(num_tokens_));
    std::abort();
  }
  if (token_bytes_ == 2) {
    const unsigned char* p = tokens_ + offset * 2;
    for (uint64_t i = 0; i < count; ++i) {
      uint16_t value;
      std::memcpy(&value, p + i * 2, 2);
      out[i] = value;
    }
  } else {
    const unsigned char* p = tokens_ + offset * 4;
    for (uint64_t i = 0; i < count; ++i) {
      uint32_t value;
      std::memcpy(&value, p + i * 4, 4);
      out[i] = value;
    }
  }
}

}  // namespace tessera::trainer
