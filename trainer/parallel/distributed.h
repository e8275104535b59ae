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
#include "common/trainer_env.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {

// The environment variables ResolveRankAssignment reads (common/trainer_env.h documents them).
using ::tessera::kDefaultMasterPort;
using ::tessera::kLocalRankEnv;
using ::tessera::kLocalWorldSizeEnv;
using ::tessera::kMasterAddrEnv;
using ::tessera::kMasterPortEnv;
using ::tessera::kRankEnv;
using ::tessera::kWorldSizeEnv;

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
  // The address Gloo's devices bind to (this rank's node address, RankAssignment.node_addr);
  // sub-groups use it too.
  std::string hostname;
};

struct ProcessGroupOptions {
  // Longest a collective (and the group's connection set-up) may block.
  absl::Duration timeout = absl::Minutes(10);
  // Longest the rendezvous may wait for every rank to reach rank 0's store: ranks of a job start
  // on several nodes, some of them slow to launch, so this is not bounded by `timeout`.
  absl::Duration rendezvous_timeout = absl::Minutes(10);
};

// Rendezvous at master_addr:master_port (rank 0 hosts the TCPStore) and join
// a group on NCCL for DEVICE_TYPE_CUDA, Gloo otherwise. UNAVAILABLE or
// DEADLINE_EXCEEDED when the rendezvous fails, naming the address;
// ALREADY_EXISTS when rank 0 cannot listen on the master port because another
// process holds it.
absl::StatusOr<JoinedGroup> JoinProcessGroup(const v1::RankAssignment& assignment,
                                             const ProcessGroupOptions& options);

// A group of `size` ranks rendezvousing through `store` (the world's store, or a PrefixStore over
// it for a sub-group), on NCCL for DEVICE_TYPE_CUDA and Gloo otherwise; `hostname` picks Gloo's
// network interface. c10::Error passes through as thrown.
absl::StatusOr<c10::intrusive_ptr<c10d::ProcessGroup>> NewProcessGroup(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, v1::DeviceType device_type,
    const std::string& hostname, const ProcessGroupOptions& options);

// Blocks until every rank of the group calls it; errors carry c10d's message.
absl::Status Barrier(JoinedGroup& group);

}  // namespace tessera::trainer
