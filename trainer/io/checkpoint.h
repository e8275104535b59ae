// The checkpoint directory protocol of a trainer job. A checkpoint of step S
// lives in <root>/step-0000000S/: one or more shard files per rank (named by
// SliceShardFileName or ShardFileName, written by the training loop; see the
// format versions below) plus manifest.pb, a binary
// tessera.v1.CheckpointManifest listing every shard with its size and
// XXH3-128 digest, and manifest.json, the same in JSON for people. Ranks write into
// <root>/.staging-step-0000000S/; rank 0 then writes the manifest and renames
// the staging directory into place, so a final directory is always complete.
// A resuming trainer takes the newest checkpoint whose shards match its
// manifest. No LibTorch here: plain files, protobuf and OpenSSL.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/checkpoint.pb.h"

namespace tessera::trainer {

// File names inside a checkpoint directory.
inline constexpr char kManifestFileName[] = "manifest.pb";
inline constexpr char kManifestJsonFileName[] = "manifest.json";
// The manifest's format_version: 2 when the shard files are safetensors files
// of tensor slices (SliceShardFileName, trainer/io/shard_file.h), which any layout
// can resume from; 1 when they are LibTorch archives (ShardFileName), which
// only the layout that wrote them can. CommitCheckpoint writes 2 when any shard
// is a ".safetensors" file, 1 otherwise; VerifyCheckpoint accepts both.
inline constexpr int kCheckpointFormatVersion = 2;
inline constexpr int kOldestCheckpointFormatVersion = 1;
// Extension of the format version 2 shard files.
inline constexpr char kSliceShardExtension[] = ".safetensors";

// "step-00000100": eight digits, more when the step needs them.
std::string CheckpointDirName(int64_t step);

// "rank-00000.pt". A rank may write more files than this one as long as their
// names start with "rank-NNNNN" (five or more digits), e.g. "rank-00000-optim.pt".
std::string ShardFileName(int rank);

// "rank-00000.safetensors": the one shard file of a rank in format version 2.
std::string SliceShardFileName(int rank);

// <root>/.staging-step-00000100: where every rank writes its shards of `step`.
std::string StagingDir(const std::string& root, int64_t step);

// Creates `root` if needed and an empty staging directory for `step`, removing
// a stale one left by a crashed attempt, and returns its path. Called by rank 0
// before a barrier; the other ranks compute the same path with StagingDir().
absl::StatusOr<std::string> PrepareStaging(const std::string& root, int64_t step);

// Rank 0, after every rank wrote its shards into StagingDir(root, step) and a
// barrier: fills `manifest.shards` from the staging directory's files (rank
// parsed from the "rank-NNNNN..." name, size, XXH3-128, and for a ".safetensors"
// file the slices its header lists, reading only the header), sets
// format_version (see kCheckpointFormatVersion), step and create_time, lists step_metrics.pb
// (trainer/io/step_metrics_log.h) in `manifest.step_metrics` when the staging directory holds one
// (its digest from `known_digests` too), writes manifest.pb and
// manifest.json, fsyncs the files and the directory, and renames it to <root>/step-... (atomically
// replacing a checkpoint of the same step). Then applies retention: with keep_last > 0, complete
// checkpoints beyond the keep_last newest are deleted (the one just committed is always kept);
// staging directories of older steps are deleted. Retention is best-effort: its failures are
// reported on stderr, never undo the commit. Returns the manifest as written, and, when
// `retired_steps` is given, sets it to the steps whose checkpoints retention deleted (taken out of
// every listing before this returns; the caller reports them so that records follow).
//
// INVALID_ARGUMENT for world_size < 1, a manifest whose step is set and is not
// `step`, or a file whose name is not a shard name; FAILED_PRECONDITION when
// the staging directory is missing or some of the world_size ranks wrote no
// shard (the message lists them) or a shard's rank is out of range, or when
// the slices of the ".safetensors" shards disagree on a tensor's dtype or
// shape, leave some of its elements out or hold some twice
// (CheckManifestSlices); DATA_LOSS naming the file when a ".safetensors"
// shard's header is malformed.
//
// `known_digests` maps shard file names to the XXH3-128 digests their writers computed while
// writing (WriteHashedFile); those shards are not read back to hash them, the others are.
//
// Fenced (trainer/io/checkpoint_fence.h): the rename and retention's renames (a deleted
// checkpoint is first renamed to <root>/.retired-step-..., deleted after) happen under the fence's
// lock, held for nothing slower than a rename, and only when <root>/FENCE is absent or holds
// `manifest.job_id` at an attempt <= `attempt`; otherwise FAILED_PRECONDITION "checkpoint write
// refused: attempt 2 of job j is fenced off by attempt 3 of job j in <root>/FENCE (...)", leaving
// the staging directory and every committed checkpoint as they were (DEADLINE_EXCEEDED when the
// lock stays held). The default attempt 0 is the most conservative: fenced off by any restart.
absl::StatusOr<v1::CheckpointManifest> CommitCheckpoint(
    const std::string& root, int64_t step, v1::CheckpointManifest manifest, int world_size,
    int keep_last, const std::map<std::string, std::string>& known_digests = {},
    int64_t attempt = 0, std::vector<int64_t>* retired_steps = nullptr);

// Receives bytes in order; returns how many it took (fewer means an error).
using ByteSink = std::function<size_t(const void* data, size_t size)>;

// Creates (or truncates) `path` and writes what `produce` passes to its sink, hashing the bytes on
// the way: returns their XXH3-128 hex, so that the shard need not be read back to be hashed. Errors
// name the path; if `produce` throws, the exception propagates after the file is closed.
absl::StatusOr<std::string> WriteHashedFile(const std::string& path,
                                            const std::function<void(const ByteSink&)>& produce);

// How much of a checkpoint VerifyCheckpoint and FindLatestCheckpoint check.
enum class DigestCheck {
  // Every shard's digest too: a full read of the checkpoint.
  kAll,
  // The manifest and each shard's presence, size and recorded digest, no data read: for a
  // resume that verifies the digests while it loads (trainer/engine/checkpointing.h).
  kNone,
};

// Re-reads <dir>/manifest.pb and checks every shard it lists, and the step metrics file when it
// lists one (CheckpointManifest.step_metrics), as a shard: the file exists,
// its size and digest match (XXH3-128, or SHA-256 for a manifest written before
// it; the digest only with DigestCheck::kAll). DATA_LOSS naming the file at
// fault, e.g.
// "<dir>/rank-00001.pt: xxh3-128 mismatch (manifest 3fa9..., file 77b0...)",
// "<dir>/rank-00001.pt: size 1200 bytes, manifest says 4096",
// "<dir>/manifest.pb: missing (incomplete checkpoint)",
// "<dir>/manifest.pb: cannot parse". NOT_FOUND when `dir` does not exist.
absl::StatusOr<v1::CheckpointManifest> VerifyCheckpoint(const std::string& dir,
                                                        DigestCheck digests = DigestCheck::kAll);

// Hashes one shard of the checkpoint in `dir` and compares it with the manifest's digest:
// DATA_LOSS "<dir>/<file>: xxh3-128 mismatch (...)" as above, or the read's error.
absl::Status VerifyShardDigest(const std::string& dir, const v1::CheckpointShard& shard);

struct FoundCheckpoint {
  // Path of the checkpoint directory, <root>/step-....
  std::string path;
  v1::CheckpointManifest manifest;
};

// The newest (highest step) checkpoint under `root` that verifies (to `digests`). Corrupted
// or partial ones are skipped, each adding one line to `*skipped` (may be
// null) naming the directory and why; staging directories are never
// considered. std::nullopt when there is none, including when `root` does not
// exist; an error only when `root` cannot be listed.
absl::StatusOr<std::optional<FoundCheckpoint>> FindLatestCheckpoint(
    const std::string& root, std::vector<std::string>* skipped,
    DigestCheck digests = DigestCheck::kAll);

// Suffix of a checkpoint directory set aside because a shard failed verification.
inline constexpr char kCorruptSuffix[] = ".corrupt";

// Renames the checkpoint directory `dir` to <dir>.corrupt (or <dir>.corrupt-2, ...) so that no
// resume, listing or retention considers it again, and keeps it for inspection. Returns the new
// path; the rename's error naming both paths.
absl::StatusOr<std::string> QuarantineCheckpoint(const std::string& dir);

// Paths of the complete checkpoints (those with a manifest.pb) under `root`,
// newest first. Does not hash: a cheap listing. Empty when `root` is missing.
std::vector<std::string> ListCheckpointDirs(const std::string& root);

}  // namespace tessera::trainer
