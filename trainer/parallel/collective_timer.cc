#include "trainer/parallel/collective_timer.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <unordered_map>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "trainer/parallel/mesh.h"
#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace tessera::trainer {
namespace {

static_assert(kCollectiveDims == kMeshGroups + 1, "one dimension per mesh group, then world");

std::atomic<bool> timing_enabled{true};
std::atomic<bool> probe_enabled{false};

struct AtomicTotals {
  std::atomic<int64_t> nanos{0};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> peer_wait_nanos{0};
};

std::array<AtomicTotals, kCollectiveKinds * kCollectiveDims>& Table() {
  static auto* table = new std::array<AtomicTotals, kCollectiveKinds * kCollectiveDims>();
  return *table;
}

void Add(int kind, int dim, int64_t nanos, int64_t bytes) {
  AtomicTotals& totals = Table()[CollectiveIndex(static_cast<CollectiveKind>(kind), dim)];
  totals.nanos.fetch_add(nanos, std::memory_order_relaxed);
  totals.calls.fetch_add(1, std::memory_order_relaxed);
  totals.bytes.fetch_add(bytes, std::memory_order_relaxed);
}

struct GroupRegistry {
  absl::Mutex mu;
  // Group pointers are compared, never dereferenced: a destroyed group's entry is overwritten when
  // a new group takes its address (a mesh registers every group it holds).
  std::unordered_map<const void*, int> dims ABSL_GUARDED_BY(mu);
};

GroupRegistry& Groups() {
  static auto* registry = new GroupRegistry();
  return *registry;
}

#if TESSERA_WITH_CUDA
// A fixed pool of event pairs: a collective takes a free pair at issue, and PollCollectiveEvents
// returns it once its end event has completed. With the pool exhausted (a step issuing more
// collectives than it holds before a poll), the collective is timed on the host instead.
constexpr int kEventPairs = 1024;

struct EventPool {
  absl::Mutex mu;
  cudaEvent_t start[kEventPairs] = {};
  cudaEvent_t end[kEventPairs] = {};
  std::vector<int> free ABSL_GUARDED_BY(mu);
  struct Pending {
    int slot;
    int kind;
    int dim;
    int64_t bytes;
  };
  std::vector<Pending> pending ABSL_GUARDED_BY(mu);
  bool initialized ABSL_GUARDED_BY(mu) = false;
};

EventPool& Events() {
  static auto* pool = new EventPool();
  return *pool;
}

int TakeEventSlot() {
  EventPool& pool = Events();
  absl::MutexLock lock(&pool.mu);
  if (!pool.initialized) {
    pool.initialized = true;
    pool.free.reserve(kEventPairs);
    pool.pending.reserve(kEventPairs);
    for (int i = kEventPairs - 1; i >= 0; --i) pool.free.push_back(i);
  }
  if (pool.free.empty()) return -1;
  const int slot = pool.free.back();
  if (pool.start[slot] == nullptr) {
    if (cudaEventCreate(&pool.start[slot]) != cudaSuccess ||
        cudaEventCreate(&pool.end[slot]) != cudaSuccess) {
      return -1;  // slot stays out of the free list: host timing from here
    }
  }
  pool.free.pop_back();
  return slot;
}
#endif

}  // namespace

const char* CollectiveKindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kSendRecv:
      return "send_recv";
  }
  return "unknown";
}

const char* CollectiveDimName(int dim) {
  if (dim >= 0 && dim < kMeshGroups) return MeshDimName(static_cast<MeshDim>(dim));
  return "world";
}

void SetCollectiveTimingEnabled(bool enabled) {
  timing_enabled.store(enabled, std::memory_order_relaxed);
}

bool CollectiveTimingEnabled() { return timing_enabled.load(std::memory_order_relaxed); }

void SetCollectiveProbeEnabled(bool enabled) {
  probe_enabled.store(enabled, std::memory_order_relaxed);
}

bool CollectiveProbeEnabled() { return probe_enabled.load(std::memory_order_relaxed); }

void RegisterCollectiveGroup(const void* group, int dim) {
  if (group == nullptr) return;
  GroupRegistry& registry = Groups();
  absl::MutexLock lock(&registry.mu);
  registry.dims[group] = dim;
}

void RegisterMeshCollectiveGroups(const DeviceMesh& mesh, const void* world_group) {
  std::vector<const void*> named;
  for (MeshDim dim : {MeshDim::kData, MeshDim::kTensor, MeshDim::kPipeline, MeshDim::kContext,
                      MeshDim::kExpert, MeshDim::kExpertData, MeshDim::kDataContext}) {
    const void* group = mesh.group(dim).get();
    if (group == nullptr) continue;
    bool seen = false;
    for (const void* other : named) seen = seen || other == group;
    if (seen) continue;
    named.push_back(group);
    RegisterCollectiveGroup(group, static_cast<int>(dim));
  }
  bool world_named = false;
  for (const void* other : named) world_named = world_named || other == world_group;
  if (!world_named) RegisterCollectiveGroup(world_group, kWorldCollectiveDim);
}

int CollectiveDimOf(const void* group) {
  GroupRegistry& registry = Groups();
  absl::MutexLock lock(&registry.mu);
  auto it = registry.dims.find(group);
  return it == registry.dims.end() ? kWorldCollectiveDim : it->second;
}

CollectiveIssue IssueCollective(CollectiveKind kind, const void* group, int64_t bytes,
                                [[maybe_unused]] bool cuda, CollectivePeers peers) {
  CollectiveIssue issue;
  if (!CollectiveTimingEnabled()) return issue;
  issue.kind = static_cast<int8_t>(kind);
  issue.dim = static_cast<int8_t>(CollectiveDimOf(group));
  issue.bytes = bytes;
  if (CollectiveProbeEnabled() && peers == CollectivePeers::kWholeGroup && group != nullptr) {
    // The caller holds `group` alive while it issues on it. The barrier returns once every member
    // has reached this collective: the time in it is the wait for the slowest one.
    auto* process_group = static_cast<c10d::ProcessGroup*>(const_cast<void*>(group));
    const auto barrier_start = std::chrono::steady_clock::now();
    process_group->barrier()->wait();
    Table()[CollectiveIndex(kind, issue.dim)].peer_wait_nanos.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                             barrier_start)
            .count(),
        std::memory_order_relaxed);
    issue.probed = true;
  }
#if TESSERA_WITH_CUDA
  if (cuda) {
    const int slot = TakeEventSlot();
    if (slot >= 0 && cudaEventRecord(Events().start[slot],
                                     c10::cuda::getCurrentCUDAStream().stream()) == cudaSuccess) {
      issue.cuda_event = static_cast<int16_t>(slot);
      return issue;
    }
    if (slot >= 0) {
      absl::MutexLock lock(&Events().mu);
      Events().free.push_back(slot);
    }
  }
#endif
  issue.issued = std::chrono::steady_clock::now();
  return issue;
}

void RecordCollective(const CollectiveIssue& issue) {
  if (issue.kind < 0) return;
#if TESSERA_WITH_CUDA
  if (issue.cuda_event >= 0) {
    EventPool& pool = Events();
    // After the wait the current stream is ordered behind the collective: its end event completes
    // once the collective has.
    const cudaError_t recorded =
        cudaEventRecord(pool.end[issue.cuda_event], c10::cuda::getCurrentCUDAStream().stream());
    absl::MutexLock lock(&pool.mu);
    if (recorded != cudaSuccess) {
      pool.free.push_back(issue.cuda_event);
      Add(issue.kind, issue.dim, 0, issue.bytes);
      return;
    }
    pool.pending.push_back({issue.cuda_event, issue.kind, issue.dim, issue.bytes});
    return;
  }
#endif
  Add(issue.kind, issue.dim,
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                           issue.issued)
          .count(),
      issue.bytes);
}

void PollCollectiveEvents() {
#if TESSERA_WITH_CUDA
  EventPool& pool = Events();
  absl::MutexLock lock(&pool.mu);
  size_t kept = 0;
  for (size_t i = 0; i < pool.pending.size(); ++i) {
    const EventPool::Pending pending = pool.pending[i];
    const cudaError_t done = cudaEventQuery(pool.end[pending.slot]);
    if (done == cudaErrorNotReady) {
      pool.pending[kept++] = pending;
      continue;
    }
    float millis = 0;
    if (done != cudaSuccess || cudaEventElapsedTime(&millis, pool.start[pending.slot],
                                                    pool.end[pending.slot]) != cudaSuccess) {
      millis = 0;
      cudaGetLastError();  // clear the sticky-free error state this query left
    }
    Add(pending.kind, pending.dim, static_cast<int64_t>(static_cast<double>(millis) * 1e6),
        pending.bytes);
    pool.free.push_back(pending.slot);
  }
  pool.pending.resize(kept);
#endif
}

CollectiveTable CollectiveSnapshot() {
  CollectiveTable snapshot;
  auto& table = Table();
  for (size_t i = 0; i < snapshot.size(); ++i) {
    snapshot[i].nanos = table[i].nanos.load(std::memory_order_relaxed);
    snapshot[i].calls = table[i].calls.load(std::memory_order_relaxed);
    snapshot[i].bytes = table[i].bytes.load(std::memory_order_relaxed);
    snapshot[i].peer_wait_nanos = table[i].peer_wait_nanos.load(std::memory_order_relaxed);
  }
  return snapshot;
}

}  // namespace tessera::trainer
