#include "trainer/io/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc >= 2.28)
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/errno_status.h"
#include "common/read_file.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "common/timestamp.h"
#include "common/xxh3.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"
#include "trainer/io/checkpoint_fence.h"
#include "trainer/io/sha256.h"
#include "trainer/io/shard_file.h"
#include "trainer/io/step_metrics_log.h"

namespace tessera::trainer {
namespace {

constexpr absl::string_view kStepPrefix = "step-";
constexpr absl::string_view kStagingPrefix = ".staging-";
// Where a replaced checkpoint of the same step goes while it is deleted, on
// file systems without RENAME_EXCHANGE.
constexpr absl::string_view kReplacedPrefix = ".replaced-";
// Where retention moves a checkpoint it deletes, under the fence's lock; deleted after it.
constexpr absl::string_view kRetiredPrefix = ".retired-";
constexpr absl::string_view kShardPrefix = "rank-";
// How many missing ranks an error message lists before it abbreviates.
constexpr size_t kMaxListedRanks = 32;

std::string JoinPath(const std::string& dir, absl::string_view name) {
  if (dir.empty() || dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

// File-system helpers on POSIX calls, which also give the errno for
// messages. (std::filesystem is safe again in LibTorch binaries since they
// name libstdc++ first; see cmake/TesseraTorch.cmake.)

// stat(2) of `path`, following symbolic links; false when it does not exist or cannot be read.
bool Stat(const std::string& path, struct stat* info) { return ::stat(path.c_str(), info) == 0; }

bool IsDirectory(const std::string& path) {
  struct stat info;
  return Stat(path, &info) && S_ISDIR(info.st_mode);
}

bool IsRegularFile(const std::string& path) {
  struct stat info;
  return Stat(path, &info) && S_ISREG(info.st_mode);
}

struct DirEntry {
  std::string name;
  bool is_directory;
  bool is_regular_file;
};

// The entries of directory `path` but "." and "..", following symbolic links for their types.
absl::StatusOr<std::vector<DirEntry>> ListDirectory(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return ErrnoToStatus(errno, path);
  std::vector<DirEntry> entries;
  while (true) {
    errno = 0;
    const dirent* entry = ::readdir(dir);
    if (entry == nullptr) break;
    std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    struct stat info;
    const bool exists = Stat(JoinPath(path, name), &info);
    entries.push_back(
        {std::move(name), exists && S_ISDIR(info.st_mode), exists && S_ISREG(info.st_mode)});
  }
  const int error = errno;
  ::closedir(dir);
  if (error != 0) return ErrnoToStatus(error, absl::StrCat(path, ": readdir"));
  return entries;
}

// Removes `path` and, for a directory, everything below it; symbolic links
// are removed, never followed. OK when `path` does not exist.
absl::Status RemoveTree(const std::string& path) {
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoToStatus(errno, path);
  }
  if (S_ISDIR(info.st_mode)) {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) return ErrnoToStatus(errno, path);
    std::vector<std::string> children;
    while (const dirent* entry = ::readdir(dir)) {
      std::string name = entry->d_name;
      if (name != "." && name != "..") children.push_back(JoinPath(path, name));
    }
    ::closedir(dir);
    for (const std::string& child : children) RETURN_IF_ERROR(RemoveTree(child));
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) return ErrnoToStatus(errno, path);
    return absl::OkStatus();
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoToStatus(errno, path);
  return absl::OkStatus();
}

// mkdir -p.
absl::Status MakeDirectories(const std::string& path) {
  if (IsDirectory(path)) return absl::OkStatus();
  const size_t slash = path.find_last_of('/', path.find_last_not_of('/'));
  if (slash != std::string::npos && slash > 0)
    RETURN_IF_ERROR(MakeDirectories(path.substr(0, slash)));
  if (::mkdir(path.c_str(), 0755) != 0 && !(errno == EEXIST && IsDirectory(path))) {
    return ErrnoToStatus(errno, absl::StrCat("mkdir ", path));
  }
  return absl::OkStatus();
}

// The step of a directory named exactly CheckpointDirName(step) after `prefix`.
std::optional<int64_t> ParseStepDirName(absl::string_view name, absl::string_view prefix) {
  if (!absl::ConsumePrefix(&name, prefix)) return std::nullopt;
  if (!absl::StartsWith(name, kStepPrefix)) return std::nullopt;
  absl::string_view digits = name.substr(kStepPrefix.size());
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit)) {
    return std::nullopt;
  }
  int64_t step = 0;
  if (!absl::SimpleAtoi(digits, &step) || CheckpointDirName(step) != name) return std::nullopt;
  return step;
}

// The rank of a shard file named "rank-<digits>..." (the digits not followed by another digit).
std::optional<int> ParseShardRank(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, kShardPrefix)) return std::nullopt;
  size_t digits = 0;
  while (digits < name.size() && absl::ascii_isdigit(name[digits])) ++digits;
  int rank = 0;
  if (digits == 0 || !absl::SimpleAtoi(name.substr(0, digits), &rank)) return std::nullopt;
  return rank;
}

struct StepDir {
  int64_t step;
  std::string path;
};

// Directories under `root` named `prefix` + CheckpointDirName(step), highest
// step first; with `require_manifest`, only those holding a manifest.pb.
// An empty list when `root` does not exist.
absl::StatusOr<std::vector<StepDir>> ListStepDirs(const std::string& root, absl::string_view prefix,
                                                  bool require_manifest) {
  std::vector<StepDir> dirs;
  struct stat info;
  if (!Stat(root, &info)) {
    if (errno == ENOENT) return dirs;
    return ErrnoToStatus(errno, root);
  }
  if (!S_ISDIR(info.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(root, ": not a directory"));
  }
  ASSIGN_OR_RETURN(std::vector<DirEntry> entries, ListDirectory(root));
  for (const DirEntry& entry : entries) {
    std::optional<int64_t> step = ParseStepDirName(entry.name, prefix);
    if (!step.has_value() || !entry.is_directory) continue;
    std::string path = JoinPath(root, entry.name);
    if (require_manifest && !IsRegularFile(JoinPath(path, kManifestFileName))) continue;
    dirs.push_back({*step, std::move(path)});
  }
  std::sort(dirs.begin(), dirs.end(),
            [](const StepDir& a, const StepDir& b) { return a.step > b.step; });
  return dirs;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::string contents;
  absl::Status read = ReadFileChunks(
      path, 1 << 16, [&](const char* data, size_t size) { contents.append(data, size); });
  if (!read.ok()) return read;
  return contents;
}

// Writes `contents` to a new file at `path` and fsyncs it.
absl::Status WriteFileSynced(const std::string& path, absl::string_view contents) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, path);
  size_t written = 0;
  while (written < contents.size()) {
    ssize_t n = ::write(fd, contents.data() + written, contents.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      int error = errno;
      ::close(fd);
      return ErrnoToStatus(error, absl::StrCat(path, ": write"));
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    int error = errno;
    ::close(fd);
    return ErrnoToStatus(error, absl::StrCat(path, ": fsync"));
  }
  if (::close(fd) != 0) return ErrnoToStatus(errno, absl::StrCat(path, ": close"));
  return absl::OkStatus();
}

// Flushes a file's or directory's data and metadata (for a directory: its entries) to disk.
absl::Status FsyncPath(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, path);
  if (::fsync(fd) != 0) {
    int error = errno;
    ::close(fd);
    return ErrnoToStatus(error, absl::StrCat(path, ": fsync"));
  }
  ::close(fd);
  return absl::OkStatus();
}

// Best-effort removal for retention: failures are reported, not returned.
void RemoveTreeReporting(const std::string& path) {
  if (absl::Status status = RemoveTree(path); !status.ok()) {
    std::cerr << "tessera checkpoint retention: cannot remove " << path << ": " << status.message()
              << "\n";
  }
}

// Moves `staging` to `final_dir`, atomically replacing an existing `final_dir`. Only renames: the
// replaced checkpoint, if any, is left under the returned path (empty when there was none) for the
// caller to delete once it has released the fence's lock.
absl::StatusOr<std::string> MoveIntoPlace(const std::string& root, int64_t step,
                                          const std::string& staging,
                                          const std::string& final_dir) {
  if (::rename(staging.c_str(), final_dir.c_str()) == 0) return std::string();
  if (errno != ENOTEMPTY && errno != EEXIST) {
    return ErrnoToStatus(errno, absl::StrCat("rename ", staging, " to ", final_dir));
  }
  // A checkpoint of this step exists (e.g. written again after a restart).
  // Swap the two atomically; the old one is then deleted from the staging path.
  if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    return staging;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    return ErrnoToStatus(errno, absl::StrCat("exchange ", staging, " with ", final_dir));
  }
  // No RENAME_EXCHANGE on this file system: move the old one aside first. A
  // crash in between leaves no checkpoint of this step, and an older one is used.
  std::string replaced = JoinPath(root, absl::StrCat(kReplacedPrefix, CheckpointDirName(step)));
  RETURN_IF_ERROR(RemoveTree(replaced));
  if (::rename(final_dir.c_str(), replaced.c_str()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("rename ", final_dir, " to ", replaced));
  }
  if (::rename(staging.c_str(), final_dir.c_str()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("rename ", staging, " to ", final_dir));
  }
  return replaced;
}

// Retention's decision, taken under the fence's lock so that a stale commit never retires a newer
// attempt's checkpoint: renames the complete checkpoints beyond the keep_last newest (the one just
// committed always kept) to <root>/.retired-step-..., out of every listing, and returns them with
// the staging directories of older steps and leftovers of earlier commits, for the caller to
// delete after releasing the lock (renames are quick; deleting a tree is not). Appends the steps
// it retired to `retired_steps`.
std::vector<std::string> RetireForRetention(const std::string& root, int64_t committed_step,
                                            int keep_last, std::vector<int64_t>& retired_steps) {
  std::vector<std::string> doomed;
  if (keep_last > 0) {
    absl::StatusOr<std::vector<StepDir>> complete =
        ListStepDirs(root, "", /*require_manifest=*/true);
    if (!complete.ok()) {
      std::cerr << "tessera checkpoint retention: " << complete.status() << "\n";
    } else {
      // The checkpoint just committed always counts as one of the kept ones,
      // even when newer ones exist (a job that resumed from an older step).
      int kept = 1;
      for (const StepDir& dir : *complete) {
        if (dir.step == committed_step) continue;
        if (kept < keep_last) {
          ++kept;
          continue;
        }
        std::string retired =
            JoinPath(root, absl::StrCat(kRetiredPrefix, CheckpointDirName(dir.step)));
        if (absl::Status cleared = RemoveTree(retired); !cleared.ok()) {
          std::cerr << "tessera checkpoint retention: cannot remove " << retired << ": "
                    << cleared.message() << "\n";
          continue;
        }
        if (::rename(dir.path.c_str(), retired.c_str()) != 0) {
          std::cerr << "tessera checkpoint retention: cannot rename " << dir.path << " to "
                    << retired << ": " << std::strerror(errno) << "\n";
          continue;
        }
        doomed.push_back(std::move(retired));
        retired_steps.push_back(dir.step);
      }
    }
  }
  for (absl::string_view prefix : {kStagingPrefix, kReplacedPrefix, kRetiredPrefix}) {
    absl::StatusOr<std::vector<StepDir>> stale =
        ListStepDirs(root, prefix, /*require_manifest=*/false);
    if (!stale.ok()) continue;
    for (const StepDir& dir : *stale) {
      if (prefix != kStagingPrefix || dir.step < committed_step) doomed.push_back(dir.path);
    }
  }
  std::sort(doomed.begin(), doomed.end());
  doomed.erase(std::unique(doomed.begin(), doomed.end()), doomed.end());
  return doomed;
}

std::string ListRanks(const std::vector<int>& ranks) {
  if (ranks.size() <= kMaxListedRanks) return absl::StrJoin(ranks, ", ");
  std::vector<int> head(ranks.begin(), ranks.begin() + kMaxListedRanks);
  return absl::StrCat(absl::StrJoin(head, ", "), ", ... (", ranks.size(), " in all)");
}

}  // namespace

std::string CheckpointDirName(int64_t step) { return absl::StrFormat("step-%08d", step); }

std::string ShardFileName(int rank) { return absl::StrFormat("rank-%05d.pt", rank); }

std::string SliceShardFileName(int rank) {
  return absl::StrFormat("rank-%05d%s", rank, kSliceShardExtension);
}

std::string StagingDir(const std::string& root, int64_t step) {
  return JoinPath(root, absl::StrCat(kStagingPrefix, CheckpointDirName(step)));
}

absl::StatusOr<std::string> PrepareStaging(const std::string& root, int64_t step) {
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("negative checkpoint step ", step));
  RETURN_IF_ERROR(MakeDirectories(root));
  std::string staging = StagingDir(root, step);
  RETURN_IF_ERROR(RemoveTree(staging));
  if (::mkdir(staging.c_str(), 0755) != 0)
    return ErrnoToStatus(errno, absl::StrCat("mkdir ", staging));
  return staging;
}

namespace {

constexpr size_t kWriteChunkBytes = size_t{2} << 20;

// Hashes byte ranges in order on a thread of its own, so that a writer's write() of one chunk and
// the hash of the previous one run at once (a save then costs max(write, hash), not their sum).
// Hash(data, size) queues a range, which must stay valid until Drain() returns.
class PipelinedHasher {
 public:
  explicit PipelinedHasher(Xxh3Hasher hasher)
      : hasher_(std::move(hasher)), thread_([this] { Run(); }) {}
  PipelinedHasher(const PipelinedHasher&) = delete;
  PipelinedHasher& operator=(const PipelinedHasher&) = delete;
  ~PipelinedHasher() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      queue_.clear();  // only after an exception left a sink call unfinished
    }
    thread_.join();
  }

  void Hash(const char* data, size_t size) {
    absl::MutexLock lock(&mu_);
    queue_.emplace_back(data, size);
  }

  // Waits until every queued range is hashed.
  void Drain() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](PipelinedHasher* h) ABSL_SHARED_LOCKS_REQUIRED(h->mu_) {
          return h->queue_.empty() && !h->busy_;
        },
        this));
  }

  std::string HexDigest() {
    Drain();
    return hasher_.HexDigest();
  }

 private:
  void Run() {
    while (true) {
      std::pair<const char*, size_t> range;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](PipelinedHasher* h) ABSL_SHARED_LOCKS_REQUIRED(h->mu_) {
              return h->stop_ || !h->queue_.empty();
            },
            this));
        if (stop_) return;
        range = queue_.front();
        queue_.pop_front();
        busy_ = true;
      }
      hasher_.Update(range.first, range.second);
      absl::MutexLock lock(&mu_);
      busy_ = false;
    }
  }

  Xxh3Hasher hasher_;  // used by the thread alone until Drain()
  absl::Mutex mu_;
  std::deque<std::pair<const char*, size_t>> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace

absl::StatusOr<std::string> WriteHashedFile(const std::string& path,
                                            const std::function<void(const ByteSink&)>& produce) {
  ScopedFd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  ASSIGN_OR_RETURN(Xxh3Hasher xxh3, Xxh3Hasher::Create());
  PipelinedHasher hasher(std::move(xxh3));
  int write_errno = 0;
  produce([&](const void* data, size_t size) -> size_t {
    const char* bytes = static_cast<const char*>(data);
    size_t done = 0;
    while (done < size) {
      // Bounded writes, each handed to the hashing thread right after it is written, while its
      // bytes are still in the CPU's caches (hashing a whole multi-GB tensor afterwards would
      // read it from memory again) and while this thread writes the next one.
      const size_t want = std::min(size - done, kWriteChunkBytes);
      const ssize_t n = write(fd.get(), bytes + done, want);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        write_errno = n < 0 ? errno : EIO;
        break;
      }
      hasher.Hash(bytes + done, static_cast<size_t>(n));
      done += static_cast<size_t>(n);
    }
    hasher.Drain();  // `data` is the caller's only until this returns
    return done;
  });
  if (write_errno != 0) return ErrnoToStatus(write_errno, path);
  if (!fd.Close()) return ErrnoToStatus(errno, path);
  return hasher.HexDigest();
}

absl::StatusOr<v1::CheckpointManifest> CommitCheckpoint(
    const std::string& root, int64_t step, v1::CheckpointManifest manifest, int world_size,
    int keep_last, const std::map<std::string, std::string>& known_digests, int64_t attempt,
    std::vector<int64_t>* retired_steps) {
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("negative checkpoint step ", step));
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world_size ", world_size, " is not positive"));
  }
  if (keep_last < 0) {
    return absl::InvalidArgumentError(absl::StrCat("keep_last ", keep_last, " is negative"));
  }
  if (manifest.step() != 0 && manifest.step() != step) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest.step ", manifest.step(), " is not the committed step ", step));
  }
  const std::string staging = StagingDir(root, step);
  if (!IsDirectory(staging)) {
    return absl::FailedPreconditionError(
        absl::StrCat(staging, ": no staging directory (call PrepareStaging first)"));
  }

  struct ShardFile {
    std::string name;
    int rank;
  };
  std::vector<ShardFile> files;
  bool has_step_metrics = false;
  ASSIGN_OR_RETURN(std::vector<DirEntry> entries, ListDirectory(staging));
  for (DirEntry& entry : entries) {
    std::string& name = entry.name;
    if (name == kManifestFileName || name == kManifestJsonFileName) continue;
    std::string path = JoinPath(staging, name);
    if (!entry.is_regular_file) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": not a regular file; a checkpoint holds only shard files"));
    }
    if (name == kStepMetricsFileName) {
      has_step_metrics = true;
      continue;
    }
    std::optional<int> rank = ParseShardRank(name);
    if (!rank.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": not a shard file name (want rank-NNNNN..., see ShardFileName)"));
    }
    if (*rank >= world_size) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": shard of rank ", *rank, " but world_size is ", world_size));
    }
    files.push_back({std::move(name), *rank});
  }
  std::sort(files.begin(), files.end(),
            [](const ShardFile& a, const ShardFile& b) { return a.name < b.name; });

  std::vector<bool> present(world_size, false);
  for (const ShardFile& file : files) present[file.rank] = true;
  std::vector<int> missing;
  for (int rank = 0; rank < world_size; ++rank) {
    if (!present[rank]) missing.push_back(rank);
  }
  if (!missing.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(staging, ": no shard from rank", missing.size() > 1 ? "s " : " ",
                     ListRanks(missing), " of world_size ", world_size));
  }

  manifest.clear_shards();
  bool has_slice_shards = false;
  for (const ShardFile& file : files) {
    std::string path = JoinPath(staging, file.name);
    RETURN_IF_ERROR(FsyncPath(path));
    struct stat info;
    if (!Stat(path, &info)) return ErrnoToStatus(errno, path);
    const int64_t size = info.st_size;
    std::string digest;
    if (auto known = known_digests.find(file.name); known != known_digests.end()) {
      digest = known->second;
    } else {
      ASSIGN_OR_RETURN(digest, Xxh3File(path));
    }
    v1::CheckpointShard* shard = manifest.add_shards();
    shard->set_rank(file.rank);
    shard->set_file(file.name);
    shard->set_size_bytes(size);
    shard->set_xxh3_128(std::move(digest));
    if (absl::EndsWith(file.name, kSliceShardExtension)) {
      has_slice_shards = true;
      ASSIGN_OR_RETURN(std::vector<v1::TensorSlice> slices, ReadShardSlices(path));
      shard->mutable_slices()->Add(std::make_move_iterator(slices.begin()),
                                   std::make_move_iterator(slices.end()));
    }
  }
  if (has_slice_shards) RETURN_IF_ERROR(CheckManifestSlices(manifest));
  manifest.clear_step_metrics();
  if (has_step_metrics) {
    const std::string path = JoinPath(staging, kStepMetricsFileName);
    RETURN_IF_ERROR(FsyncPath(path));
    struct stat info;
    if (!Stat(path, &info)) return ErrnoToStatus(errno, path);
    std::string digest;
    if (auto known = known_digests.find(kStepMetricsFileName); known != known_digests.end()) {
      digest = known->second;
    } else {
      ASSIGN_OR_RETURN(digest, Xxh3File(path));
    }
    v1::CheckpointFile* file = manifest.mutable_step_metrics();
    file->set_file(kStepMetricsFileName);
    file->set_size_bytes(info.st_size);
    file->set_xxh3_128(std::move(digest));
  }
  manifest.set_format_version(has_slice_shards ? kCheckpointFormatVersion
                                               : kOldestCheckpointFormatVersion);
  manifest.set_step(step);
  *manifest.mutable_create_time() = NowTimestamp();

  std::string binary;
  if (!manifest.SerializeToString(&binary)) {
    return absl::InternalError(absl::StrCat(staging, ": cannot serialize the manifest"));
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions json_options;
  json_options.add_whitespace = true;
  json_options.preserve_proto_field_names = true;
  json_options.always_print_primitive_fields = true;
  if (auto status = google::protobuf::util::MessageToJsonString(manifest, &json, json_options);
      !status.ok()) {
    return absl::InternalError(
        absl::StrCat(staging, ": cannot write the manifest as JSON: ", status.ToString()));
  }
  // manifest.json first: the binary manifest is what marks the directory complete.
  RETURN_IF_ERROR(WriteFileSynced(JoinPath(staging, kManifestJsonFileName), json));
  RETURN_IF_ERROR(WriteFileSynced(JoinPath(staging, kManifestFileName), binary));
  RETURN_IF_ERROR(FsyncPath(staging));

  // The fence check, the rename and retention's renames under one lock: a newer attempt's raise
  // (taken before it loads) either comes first and this commit is refused, or waits for it, so a
  // stale commit never replaces nor retires a newer attempt's checkpoint. Only renames run under
  // it: a process frozen (SIGSTOP) while holding it would hold back the next attempt's start.
  const std::string final_dir = JoinPath(root, CheckpointDirName(step));
  std::vector<std::string> to_delete;
  {
    ASSIGN_OR_RETURN(FenceLock fence_lock, FenceLock::Acquire(root));
    RETURN_IF_ERROR(CheckCheckpointFenceLocked(root, manifest.job_id(), attempt));
    ASSIGN_OR_RETURN(std::string replaced, MoveIntoPlace(root, step, staging, final_dir));
    if (!replaced.empty()) to_delete.push_back(std::move(replaced));
    std::vector<int64_t> retired_now;
    std::vector<std::string> retired = RetireForRetention(root, step, keep_last, retired_now);
    if (retired_steps != nullptr) *retired_steps = std::move(retired_now);
    to_delete.insert(to_delete.end(), retired.begin(), retired.end());
  }
  RETURN_IF_ERROR(FsyncPath(root));
  for (const std::string& path : to_delete) RemoveTreeReporting(path);
  return manifest;
}

absl::StatusOr<v1::CheckpointManifest> VerifyCheckpoint(const std::string& dir,
                                                        DigestCheck digests) {
  if (!IsDirectory(dir)) {
    return absl::NotFoundError(absl::StrCat(dir, ": no such checkpoint directory"));
  }
  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  struct stat manifest_info;
  if (!Stat(manifest_path, &manifest_info) && errno == ENOENT) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": missing (incomplete checkpoint)"));
  }
  ASSIGN_OR_RETURN(std::string bytes, ReadFile(manifest_path));
  v1::CheckpointManifest manifest;
  if (!manifest.ParseFromString(bytes)) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": cannot parse"));
  }
  if (manifest.format_version() < kOldestCheckpointFormatVersion ||
      manifest.format_version() > kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        manifest_path, ": format_version ", manifest.format_version(), ", this build reads ",
        kOldestCheckpointFormatVersion, " to ", kCheckpointFormatVersion));
  }
  if (manifest.shards().empty()) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": lists no shards"));
  }
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    const std::string& name = shard.file();
    if (name.empty() || name == "." || name == ".." || absl::StrContains(name, '/')) {
      return absl::DataLossError(
          absl::StrCat(manifest_path, ": shard file name \"", name, "\" is not a plain file name"));
    }
    const std::string path = JoinPath(dir, name);
    struct stat info;
    if (!Stat(path, &info) || !S_ISREG(info.st_mode)) {
      return absl::DataLossError(absl::StrCat(path, ": missing (listed in the manifest)"));
    }
    const int64_t size = info.st_size;
    if (size != shard.size_bytes()) {
      return absl::DataLossError(
          absl::StrCat(path, ": size ", size, " bytes, manifest says ", shard.size_bytes()));
    }
    if (shard.xxh3_128().empty() && shard.sha256().empty()) {
      return absl::DataLossError(absl::StrCat(path, ": the manifest records no digest of it"));
    }
    if (digests == DigestCheck::kAll) RETURN_IF_ERROR(VerifyShardDigest(dir, shard));
  }
  if (manifest.has_step_metrics()) {
    // Checked as a shard is; its digest only with kAll (a resume checks it when it reads it).
    const v1::CheckpointFile& listed = manifest.step_metrics();
    v1::CheckpointShard as_shard;
    as_shard.set_file(listed.file());
    as_shard.set_size_bytes(listed.size_bytes());
    as_shard.set_xxh3_128(listed.xxh3_128());
    const std::string& name = listed.file();
    if (name.empty() || name == "." || name == ".." || absl::StrContains(name, '/')) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": step metrics file name \"", name,
                                              "\" is not a plain file name"));
    }
    const std::string path = JoinPath(dir, name);
    struct stat info;
    if (!Stat(path, &info) || !S_ISREG(info.st_mode)) {
      return absl::DataLossError(absl::StrCat(path, ": missing (listed in the manifest)"));
    }
    if (info.st_size != listed.size_bytes()) {
      return absl::DataLossError(absl::StrCat(path, ": size ", info.st_size,
                                              " bytes, manifest says ", listed.size_bytes()));
    }
    if (listed.xxh3_128().empty()) {
      return absl::DataLossError(absl::StrCat(path, ": the manifest records no digest of it"));
    }
    if (digests == DigestCheck::kAll) RETURN_IF_ERROR(VerifyShardDigest(dir, as_shard));
  }
  return manifest;
}

absl::Status VerifyShardDigest(const std::string& dir, const v1::CheckpointShard& shard) {
  const std::string path = JoinPath(dir, shard.file());
  // XXH3-128 since it replaced SHA-256; older manifests hold only the SHA-256.
  const bool xxh3 = !shard.xxh3_128().empty();
  ASSIGN_OR_RETURN(std::string digest, xxh3 ? Xxh3File(path) : Sha256File(path));
  const std::string& expected = xxh3 ? shard.xxh3_128() : shard.sha256();
  if (digest != expected) {
    return absl::DataLossError(absl::StrCat(path, ": ", xxh3 ? "xxh3-128" : "sha256",
                                            " mismatch (manifest ", expected, ", file ", digest,
                                            ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<FoundCheckpoint>> FindLatestCheckpoint(
    const std::string& root, std::vector<std::string>* skipped, DigestCheck digests) {
  ASSIGN_OR_RETURN(std::vector<StepDir> dirs, ListStepDirs(root, "", /*require_manifest=*/false));
  for (StepDir& dir : dirs) {
    absl::StatusOr<v1::CheckpointManifest> manifest = VerifyCheckpoint(dir.path, digests);
    if (!manifest.ok()) {
      if (skipped != nullptr) {
        skipped->push_back(absl::StrCat(dir.path, ": skipped: ", manifest.status().message()));
      }
      continue;
    }
    if (manifest->step() != dir.step) {
      if (skipped != nullptr) {
        skipped->push_back(
            absl::StrCat(dir.path, ": skipped: manifest says step ", manifest->step()));
      }
      continue;
    }
    return FoundCheckpoint{std::move(dir.path), *std::move(manifest)};
  }
  return std::nullopt;
}

absl::StatusOr<std::string> QuarantineCheckpoint(const std::string& dir) {
  std::string target = absl::StrCat(dir, kCorruptSuffix);
  struct stat info;
  for (int n = 2; Stat(target, &info); ++n) target = absl::StrCat(dir, kCorruptSuffix, "-", n);
  if (::rename(dir.c_str(), target.c_str()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("rename ", dir, " to ", target));
  }
  const size_t slash = dir.find_last_of('/');
  RETURN_IF_ERROR(FsyncPath(slash == std::string::npos ? "." : dir.substr(0, slash)));
  return target;
}

std::vector<std::string> ListCheckpointDirs(const std::string& root) {
  absl::StatusOr<std::vector<StepDir>> dirs = ListStepDirs(root, "", /*require_manifest=*/true);
  std::vector<std::string> paths;
  if (!dirs.ok()) return paths;
  for (StepDir& dir : *dirs) paths.push_back(std::move(dir.path));
  return paths;
}

}  // namespace tessera::trainer
