// Where a rank's collective time goes: every blocking collective of a training step records its
// kind (all-reduce, reduce-scatter, ...), the mesh dimension of its group (dp, tp, pp, ...), the
// bytes of this rank's input and its time from issue to the end of its wait into one
// process-wide table, which the step timer (trainer/runtime/step_timer.h) reads once per step.
// The call sites are the ones trainer/parallel/peer_wait.h lists: each takes an IssueCollective()
// right before issuing and hands it to WaitForPeers(work, issue).
//
// Cost: on the hot path two clock reads, one lookup of the group's dimension (a mutex and a hash
// of a pointer) and three relaxed atomic adds into a fixed kind x dimension array: no allocation.
// On CUDA tensors the time is instead that between two CUDA events recorded on the current stream
// (before the issue, after the wait has ordered the stream behind the collective), read by
// PollCollectiveEvents() one step later without synchronising (cudaEventQuery).
//
// The probe (--collective_probe, off by default: it slows training) separates the wait for the
// group's slowest member from the transfer: each collective that every member of its group issues
// is preceded by a barrier on the group, whose host time is the collective's peer wait, and is
// waited for right after its issue (WaitNowWhenProbing in peer_wait.h), so that its own time is
// the transfer alone, not the compute it would overlap. Pipeline sends and receives, which the
// stages issue at different points of their schedules, get no barrier (a barrier there would
// deadlock) and keep their issue-to-wait time. The barrier's own latency (a small all-reduce)
// counts as peer wait.
//
// Thread safety: every function may be called from any thread. With ranks as threads of one
// process (tests) the table holds the sum over those ranks.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace tessera::trainer {

class DeviceMesh;

enum class CollectiveKind : int8_t {
  kAllReduce = 0,
  kReduceScatter = 1,
  kAllGather = 2,
  kAllToAll = 3,
  kBroadcast = 4,
  // Point-to-point: pipeline activations and gradients, ring attention's K/V.
  kSendRecv = 5,
};
inline constexpr int kCollectiveKinds = 6;
// The dimensions a collective is attributed to: the mesh's groups (MeshDim's values, kMeshGroups
// of them) and, last, the world group when it is none of them. Kept free of mesh.h so that this
// header (and peer_wait.h) needs no LibTorch.
inline constexpr int kCollectiveDims = 8;
inline constexpr int kWorldCollectiveDim = kCollectiveDims - 1;

// "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv".
const char* CollectiveKindName(CollectiveKind kind);
// MeshDimName for the mesh's dimensions, "world" for kWorldCollectiveDim.
const char* CollectiveDimName(int dim);

// Totals of one kind on one dimension since the process started.
struct CollectiveTotals {
  int64_t nanos = 0;
  int64_t calls = 0;
  int64_t bytes = 0;
  // Time in the probe's barriers before these collectives (0 with the probe off); not in nanos.
  int64_t peer_wait_nanos = 0;
};
using CollectiveTable = std::array<CollectiveTotals, kCollectiveKinds * kCollectiveDims>;

inline int CollectiveIndex(CollectiveKind kind, int dim) {
  return static_cast<int>(kind) * kCollectiveDims + dim;
}

// Whether collectives are timed (default true). Off, IssueCollective reads no clock and records
// nothing (--step_breakdown=false).
void SetCollectiveTimingEnabled(bool enabled);
bool CollectiveTimingEnabled();

// Whether collectives are probed (default false): see the top of this file. Probing needs timing.
void SetCollectiveProbeEnabled(bool enabled);
bool CollectiveProbeEnabled();

// Who issues a collective: every member of its group (all collectives, ring attention's hops),
// or only some of them at this point (a pipeline stage's send or receive).
enum class CollectivePeers : int8_t { kWholeGroup = 0, kSome = 1 };

// Names the dimension of `group` (a c10d::ProcessGroup*) for the collectives issued on it. A
// group that several of a mesh's dimensions share takes the first of dp, tp, pp, cp, ep, edp,
// dcp (so a dp-only job's dp group, which is also the world group, reads "dp"). Groups never
// registered read "world". Called by DeviceMesh::Create for every group it holds.
void RegisterCollectiveGroup(const void* group, int dim);
void RegisterMeshCollectiveGroups(const DeviceMesh& mesh, const void* world_group);
int CollectiveDimOf(const void* group);

// A collective as issued: what the wait hands to RecordCollective.
struct CollectiveIssue {
  // -1: not timed.
  int8_t kind = -1;
  int8_t dim = 0;
  // Index of its CUDA start event in the event pool; -1 when timed on the host.
  int16_t cuda_event = -1;
  // Probed: its caller waits for it right after issuing it (WaitNowWhenProbing).
  bool probed = false;
  int64_t bytes = 0;
  std::chrono::steady_clock::time_point issued;
};

// Marks the issue of a collective of `kind` over `group` (a c10d::ProcessGroup*, or nullptr)
// with `bytes` of this rank's input; `cuda` when its tensors are on a CUDA device (then timed
// with events on the current stream). With the probe on and `peers` the whole group, first waits
// in a barrier on `group` and adds that time to the collective's peer wait.
CollectiveIssue IssueCollective(CollectiveKind kind, const void* group, int64_t bytes, bool cuda,
                                CollectivePeers peers = CollectivePeers::kWholeGroup);

// Bytes of a list of tensors (anything with numel() and element_size()).
template <typename Tensors>
int64_t TensorBytes(const Tensors& tensors) {
  int64_t bytes = 0;
  for (const auto& tensor : tensors) {
    bytes += static_cast<int64_t>(tensor.numel()) * static_cast<int64_t>(tensor.element_size());
  }
  return bytes;
}

// The collective `issue` finished waiting now: adds it to the table (on CUDA, once its events are
// read by PollCollectiveEvents).
void RecordCollective(const CollectiveIssue& issue);

// Adds the collectives whose CUDA end events have completed to the table; ones still running are
// kept for a later call. Never blocks. A no-op without CUDA.
void PollCollectiveEvents();

// The table now.
CollectiveTable CollectiveSnapshot();

}  // namespace tessera::trainer
