// How long this rank has spent blocked waiting for its peers in collectives, so that a heartbeat
// can tell a straggler from the ranks that wait for it: in synchronous training every rank's step
// takes the slowest rank's wall time, but only the slowest spends little of it waiting.
//
// What is counted: the host time spent in Work::wait() of the blocking collectives of a training
// step: the gradient reductions and ZeRO parameter gathers of trainer/engine/sharded_engine.cc
// (and its gradient-norm all-reduce), the pipeline's activation and gradient sends and receives
// (trainer/parallel/pipeline.cc), the tensor-parallel collectives
// (trainer/parallel/tensor_parallel.cc) and the loss all-reduce of trainer/runtime/train_loop.cc.
// Not counted: checkpoint and evaluation collectives, which fall outside a step's busy time
// anyway. On NCCL, wait() only orders the CUDA stream, so the host sees little of the wait and
// busy time reads high on every rank alike.
//
// The same waits, given the CollectiveIssue taken when their collective was issued, also record
// the collective's kind, dimension, bytes and time (trainer/parallel/collective_timer.h).
//
// Thread safety: the counter is one process-wide atomic; any thread may add to or read it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "trainer/parallel/collective_timer.h"

namespace tessera::trainer {

// Nanoseconds spent waiting for peers since the process started.
inline std::atomic<int64_t>& PeerWaitNanos() {
  static std::atomic<int64_t> nanos{0};
  return nanos;
}

inline double PeerWaitSeconds() {
  return static_cast<double>(PeerWaitNanos().load(std::memory_order_relaxed)) * 1e-9;
}

// Adds the time from construction to destruction to PeerWaitNanos().
class ScopedPeerWait {
 public:
  ScopedPeerWait() : start_(std::chrono::steady_clock::now()) {}
  ~ScopedPeerWait() {
    PeerWaitNanos().fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - start_)
                                  .count(),
                              std::memory_order_relaxed);
  }
  ScopedPeerWait(const ScopedPeerWait&) = delete;
  ScopedPeerWait& operator=(const ScopedPeerWait&) = delete;

 private:
  const std::chrono::steady_clock::time_point start_;
};

// work->wait(), counted as waiting for peers. `Work` is a c10d::Work handle (kept generic so
// this header needs no LibTorch).
template <typename WorkPtr>
void WaitForPeers(const WorkPtr& work) {
  ScopedPeerWait counted;
  work->wait();
}

// WaitForPeers(work), then records the collective `issue` marked (IssueCollective, taken right
// before the collective was issued). A wait that throws records nothing.
template <typename WorkPtr>
void WaitForPeers(const WorkPtr& work, const CollectiveIssue& issue) {
  WaitForPeers(work);
  RecordCollective(issue);
}

// With the collective probe on (collective_timer.h), waits for the collective `issue` marked right
// away and records it, so that its time is the transfer alone rather than the compute its caller
// overlaps with it; `issue` is then spent, and the caller's later WaitForPeers(work, *issue)
// returns at once and records nothing. Without the probe, does nothing.
template <typename WorkPtr>
void WaitNowWhenProbing(const WorkPtr& work, CollectiveIssue* issue) {
  if (!issue->probed) return;
  WaitForPeers(work, *issue);
  *issue = CollectiveIssue{};
}

}  // namespace tessera::trainer
