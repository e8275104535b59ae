// Context parallelism's attention (Liu et al. 2023, "Ring Attention"; Megatron-Core's and
// torchtitan's context parallel): the sequence is split over the cp ranks, each rank keeps the
// queries of its own tokens, and the keys and values travel around the ring so that every query
// meets every key it may attend to. Partial results are merged exactly with the online softmax
// (a running log-sum-exp per query row), so the output equals full causal attention up to
// floating-point rounding.
//
// Load balancing: with causal attention the late tokens attend to many more keys than the early
// ones, so a contiguous split would leave rank 0 idle most of the time. The sequence is cut into
// 2 * cp equal chunks and rank i holds chunks i and 2cp-1-i, in that order (one early, one
// late), as Megatron-Core and torchtitan do; every rank then does the same work. The helpers
// below split a global tensor into a rank's part, put the parts back together, and give the
// global positions a rank holds (what rotary embeddings need).
//
// Ring schedule (forward): step s = 0 .. cp-1, rank r holds the keys and values of rank
// (r - s) mod cp; before computing with them it posts the send of that block to rank r+1 and the
// receive of the next one from rank r-1, so the transfer overlaps the step's compute (cp-1
// transfers of one packed [2, batch, kv_heads, local_seq, head_dim] tensor). Per pair of chunks
// the mask is decided from the chunks' global order: a key chunk before the query chunk is fully
// visible, the same chunk is causal, a later chunk is skipped without computing.
//
// Backward (exact, recomputing per block from the saved output and log-sum-exp as
// FlashAttention does): the keys and values go around the ring again together with the
// gradient accumulated for them; each rank adds its queries' contribution to the visiting
// block's dK/dV and passes the accumulator on. Per step s the rank posts the K/V hop for step
// s+1, computes, waits for the dK/dV accumulator of its current block (from rank r-1, sent at
// step s-1), adds its contribution, posts that accumulator to rank r+1, then waits for the K/V
// hop: cp-1 K/V hops and cp dK/dV hops in all. The last dK/dV hop brings each rank the complete
// gradient of its own block; dQ never leaves the rank.
//
// Blocks compute in float32 or wider: bf16 inputs are upcast once per call, and the result is
// cast back. Memory per rank beyond the inputs: forward holds two K/V blocks (the one in use and
// the one in flight) and the output accumulator and log-sum-exp in float32 or wider, plus, per
// block, either the kv heads repeated for the CPU flash kernel or (explicit attention, other
// devices) one block of scores [batch, heads, local_seq/2, local_seq]; a CUDA flash kernel is the
// follow-up. Saved for backward: q, k, v, the output and the log-sum-exp. Backward holds two K/V
// blocks, up to three dK/dV buffers (the one being summed, the one in flight out, the one arriving)
// and two score-sized blocks when explicit.
//
// Threading: collectives are issued on the calling thread (forward) or autograd's (backward) and
// waited for before returning; every cp rank must call with the same shapes in the same order.
// The process group must outlive the backward pass, and no other point-to-point traffic on it
// may use tags 41 to 43 meanwhile.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "absl/status/status.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {

struct ContextParallel {
  // The ranks that share one sequence; null when size is 1. The group's rank is the cp rank.
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int rank = 0;
  int size = 1;
  bool enabled() const { return size > 1; }
};

// OK when a sequence of `seq_len` tokens can be split over `cp` ranks (2 * cp chunks of equal
// length); INVALID_ARGUMENT naming seq_len and context_parallel otherwise.
absl::Status CheckContextParallelSequence(int64_t seq_len, int cp);

// The global chunk indices rank `rank` of `cp` holds, in its local order: {rank, 2cp-1-rank}.
std::array<int64_t, 2> ContextParallelChunks(int rank, int cp);

// The global positions (int64, [seq_len / cp]) rank `rank` holds, in its local order. Throws
// c10::Error with CheckContextParallelSequence's message when seq_len does not split.
torch::Tensor ContextParallelPositions(int64_t seq_len, int rank, int cp);

// Rank `rank`'s part of the global tensor `full` along `seq_dim`: its two chunks, concatenated
// (a copy). Throws c10::Error when the length does not split.
torch::Tensor ShardForContextParallel(const torch::Tensor& full, int rank, int cp,
                                      int64_t seq_dim = 1);

// The inverse: the global tensor from every rank's part, `shards[r]` being rank r's.
torch::Tensor GatherFromContextParallel(const std::vector<torch::Tensor>& shards,
                                        int64_t seq_dim = 1);

struct RingAttentionOptions {
  // Softmax scale; 1/sqrt(head_dim) when unset.
  std::optional<double> scale = std::nullopt;
  // Blocks on CPU run LibTorch's flash-attention kernel (returns the log-sum-exp, recomputes in
  // its backward), repeating kv heads for it; otherwise, and on other devices for now, explicit
  // attention that materializes one block of scores. Both are exact; tests run both.
  bool fused_kernel = true;
};

// Causal attention of this rank's queries over the whole sequence's keys and values.
// q: [batch, heads, local_seq, head_dim]; k, v: [batch, kv_heads, local_seq, head_dim] with
// kv_heads dividing heads (grouped-query attention: query head h uses kv head h / (heads /
// kv_heads), as scaled_dot_product_attention's enable_gqa). local_seq holds the rank's two
// chunks as ShardForContextParallel lays them out.
// Returns [batch, heads, local_seq, head_dim] in q's dtype; differentiable in q, k and v. With cp
// of size 1 it is plain causal attention and communicates nothing. Throws c10::Error on shapes
// that do not fit (odd local_seq, kv_heads not dividing heads, ...).
torch::Tensor RingAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const ContextParallel& cp, const RingAttentionOptions& options = {});

}  // namespace tessera::trainer
