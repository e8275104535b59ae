// A trainer rank's place in its job and its c10d process group: the
// torchrun-compatible environment, rendezvous through rank 0's TCPStore, and
// a ProcessGroup on NCCL (CUDA) or Gloo (CPU).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {

// Environment variable names, as torchrun sets them.
// Global rank of the process.
inline constexpr char kRankEnv[] = "RANK";
// Number of processes in the job.
inline constexpr char kWorldSizeEnv[] = "WORLD_SIZE";
// Rank among the job's processes on this node.
inline constexpr char kLocalRankEnv[] = "LOCAL_RANK";
// Number of the job's processes on this node.
inline constexpr char kLocalWorldSizeEnv[] = "LOCAL_WORLD_SIZE";
// Host of rank 0's TCPStore.
inline constexpr char kMasterAddrEnv[] = "MASTER_ADDR";
// Port of rank 0's TCPStore.
inline constexpr char kMasterPortEnv[] = "MASTER_PORT";

// Reads an environment variable; nullptr when unset. main() passes getenv.
using EnvLookup = std::function<const char*(const char*)>;

// The assignment with the environment laid over it: the environment wins for
// each variable that is set. INVALID_ARGUMENT naming the variable for values
// that do not parse or are out of range (rank >= world size, ...).
absl::StatusOr<v1::RankAssignment> ResolveRankAssignment(const v1::RankAssignment& assignment,
                                                         const EnvLookup& env);

// A joined c10d process group and the store it rendezvoused through.
struct JoinedGroup {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  // "gloo" or "nccl".
  std::string backend;
};

struct ProcessGroupOptions {
  // Longest a rendezvous or collective may block.
  absl::Duration timeout = absl::Minutes(10);
};

// Rendezvous at master_addr:master_port (rank 0 hosts the TCPStore) and join
// a group on NCCL for DEVICE_TYPE_CUDA, Gloo otherwise. UNAVAILABLE or
// DEADLINE_EXCEEDED when the rendezvous fails, naming the address.
absl::StatusOr<JoinedGroup> JoinProcessGroup(const v1::RankAssignment& assignment,
                                             const ProcessGroupOptions& options);

// Blocks until every rank of the group calls it; errors carry c10d's message.
absl::Status Barrier(JoinedGroup& group);

}  // namespace tessera::trainer
