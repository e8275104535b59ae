#include "trainer/parallel/ring_attention.h"

#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "trainer/parallel/peer_wait.h"

namespace tessera::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// c10d tags of the ring's messages, so that a forward block is never matched with a backward one.
constexpr int kForwardKvTag = 41;
constexpr int kBackwardKvTag = 42;
constexpr int kBackwardGradTag = 43;

std::string SequenceError(int64_t seq_len, int cp) {
  return absl::StrCat("seq_len ", seq_len, " is not divisible by 2 * context_parallel (",
                      2 * static_cast<int64_t>(cp),
                      "): context parallelism cuts the sequence into 2 * cp equal chunks");
}

void CheckSequence(int64_t seq_len, int cp) {
  TORCH_CHECK(cp >= 1, "context_parallel ", cp, " must be at least 1");
  TORCH_CHECK(seq_len > 0 && seq_len % (2 * cp) == 0, SequenceError(seq_len, cp));
}

// Accumulate in float32 at least (bf16 inputs), in float64 for float64 inputs.
at::ScalarType AccumulateType(const at::Tensor& t) {
  return at::promote_types(t.scalar_type(), at::kFloat);
}

// How a chunk of queries sees a chunk of keys under the causal mask.
enum class Visibility { kFull, kCausal, kNone };

Visibility VisibilityOf(int64_t query_chunk, int64_t key_chunk) {
  if (key_chunk < query_chunk) return Visibility::kFull;
  return key_chunk == query_chunk ? Visibility::kCausal : Visibility::kNone;
}

// The keys a local half of queries attends to in one block, as ranges of the block's local
// sequence: `full` a contiguous range seen entirely (length 0 when none) and `causal` the half
// seen under the diagonal mask (-1 when none). The two halves of a block are contiguous, so the
// fully visible keys are always one range.
struct HalfPlan {
  int64_t full_begin = 0;
  int64_t full_length = 0;
  int causal_half = -1;
};

HalfPlan PlanHalf(int64_t query_chunk, const std::array<int64_t, 2>& key_chunks, int64_t chunk) {
  HalfPlan plan;
  bool full[2];
  for (int h = 0; h < 2; ++h) {
    const Visibility visibility = VisibilityOf(query_chunk, key_chunks[h]);
    full[h] = visibility == Visibility::kFull;
    if (visibility == Visibility::kCausal) plan.causal_half = h;
  }
  if (full[0] && full[1]) {
    plan.full_length = 2 * chunk;
  } else if (full[0] || full[1]) {
    plan.full_begin = full[0] ? 0 : chunk;
    plan.full_length = chunk;
  }
  return plan;
}

// Scores of queries q [batch, heads, m, d] against keys k [batch, kv_heads, n, d], grouped as
// [batch, kv_heads, group, m, n] so that a kv head is shared by its query heads without copies;
// the diagonal mask (m == n, aligned) sets the keys after each query to -inf.
at::Tensor Scores(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  const int64_t kv_heads = k.size(1);
  at::Tensor grouped = q.unflatten(1, {kv_heads, q.size(1) / kv_heads});
  at::Tensor scores = at::matmul(grouped, k.unsqueeze(2).transpose(-1, -2)).mul_(scale);
  if (causal) {
    const at::Tensor later =
        at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu_(1);
    scores.masked_fill_(later, -std::numeric_limits<double>::infinity());
  }
  return scores;
}

// k or v [batch, kv_heads, n, d] with each kv head repeated for its query heads, as LibTorch's
// flash kernel wants them (it has no grouped-query form).
at::Tensor RepeatKvHeads(const at::Tensor& t, int64_t heads) {
  const int64_t group = heads / t.size(1);
  return group == 1 ? t.contiguous() : t.repeat_interleave(group, 1);
}

// Whether blocks run LibTorch's CPU flash-attention kernel (which returns the log-sum-exp and
// takes it back in its backward) instead of explicit attention.
bool UseFlashCpu(const at::Tensor& q, bool fused_kernel) { return fused_kernel && q.is_cpu(); }

// Softmax attention of one block: the normalized output [batch, heads, m, d] and the log-sum-exp
// of the scores [batch, heads, m]. Every query row sees at least one key (the diagonal is never
// masked), so the log-sum-exp is finite.
std::pair<at::Tensor, at::Tensor> AttendBlock(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, bool causal, double scale,
                                              bool fused_kernel) {
  if (UseFlashCpu(q, fused_kernel)) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), RepeatKvHeads(k, q.size(1)), RepeatKvHeads(v, q.size(1)),
        /*dropout_p=*/0.0, causal, /*attn_mask=*/std::nullopt, scale);
    return {out.to(q.scalar_type()), lse.to(q.scalar_type())};
  }
  at::Tensor scores = Scores(q, k, causal, scale);
  at::Tensor lse = scores.logsumexp(-1);
  at::Tensor probs = scores.sub_(lse.unsqueeze(-1)).exp_();
  at::Tensor out = at::matmul(probs, v.unsqueeze(2));
  return {out.flatten(1, 2), lse.flatten(1, 2)};
}

// Online-softmax merge of a block's (out, lse) into the running (out, lse) views, in place.
void MergeBlock(at::Tensor out, at::Tensor lse, const at::Tensor& block_out,
                const at::Tensor& block_lse) {
  at::Tensor merged = at::logaddexp(lse, block_lse);
  at::Tensor kept = (lse - merged).exp_().unsqueeze(-1);
  at::Tensor added = (block_lse - merged).exp_().unsqueeze(-1);
  out.mul_(kept).add_(block_out * added);
  lse.copy_(merged);
}

// One block's backward: adds the queries' gradient into dq and returns the block's (dk, dv)
// contributions [batch, kv_heads, n, d]. `out`, `lse` and `delta` (rowsum(dO * out)) are the
// final ones of the whole attention, so exp(scores - lse) is the block's share of the full
// softmax (the flash kernel computes delta from `out` itself).
std::pair<at::Tensor, at::Tensor> BackwardBlock(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& grad_out,
                                                const at::Tensor& out, const at::Tensor& lse,
                                                const at::Tensor& delta, at::Tensor dq, bool causal,
                                                double scale, bool fused_kernel) {
  const int64_t kv_heads = k.size(1), group = q.size(1) / kv_heads;
  if (UseFlashCpu(q, fused_kernel)) {
    auto [block_dq, block_dk, block_dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), q.contiguous(), RepeatKvHeads(k, q.size(1)),
        RepeatKvHeads(v, q.size(1)), out.contiguous(), lse.contiguous(), /*dropout_p=*/0.0, causal,
        /*attn_mask=*/std::nullopt, scale);
    dq.add_(block_dq);
    return {block_dk.unflatten(1, {kv_heads, group}).sum(2),
            block_dv.unflatten(1, {kv_heads, group}).sum(2)};
  }
  at::Tensor probs =
      Scores(q, k, causal, scale).sub_(lse.unflatten(1, {kv_heads, group}).unsqueeze(-1)).exp_();
  at::Tensor grad_grouped = grad_out.unflatten(1, {kv_heads, group});
  at::Tensor dv = at::matmul(probs.transpose(-1, -2), grad_grouped).sum(2);
  at::Tensor dprobs = at::matmul(grad_grouped, v.unsqueeze(2).transpose(-1, -2));
  at::Tensor dscores =
      probs.mul_(dprobs.sub_(delta.unflatten(1, {kv_heads, group}).unsqueeze(-1))).mul_(scale);
  dq.add_(at::matmul(dscores, k.unsqueeze(2)).flatten(1, 2));
  at::Tensor dk = at::matmul(dscores.transpose(-1, -2), q.unflatten(1, {kv_heads, group})).sum(2);
  return {dk, dv};
}

// One hop of the ring in flight: `outgoing` to rank + 1, `incoming` from rank - 1. NCCL needs the
// pair coalesced (with cp 2 both go to the same peer, and two unmatched blocking kernels would
// deadlock); Gloo posts both and waits for each.
class RingHop {
 public:
  // `what` names the payload in errors ("K/V", "dK/dV").
  RingHop(c10d::ProcessGroup* group, const at::Tensor& outgoing, const at::Tensor& incoming,
          int tag, const char* what)
      : what_(what), outgoing_{outgoing}, incoming_{incoming} {
    const int size = group->getSize();
    rank_ = group->getRank();
    next_ = (rank_ + 1) % size;
    prev_ = (rank_ - 1 + size) % size;
    // Only NCCL coalesces; asking a Gloo-only group for its CUDA backend would throw.
    const bool coalesce =
        outgoing.is_cuda() && group->getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
    // One hop is one send_recv: this rank's outgoing and incoming bytes.
    issue_ = IssueCollective(CollectiveKind::kSendRecv, group,
                             TensorBytes(outgoing_) + TensorBytes(incoming_), outgoing.is_cuda());
    if (coalesce) group->startCoalescing(c10::DeviceType::CUDA);
    works_.push_back(group->send(outgoing_, next_, tag));
    works_.push_back(group->recv(incoming_, prev_, tag));
    if (coalesce) {
      works_.clear();
      works_.push_back(group->endCoalescing(c10::DeviceType::CUDA));
    }
    // Probing, the hop completes here, before the attention it would overlap (Wait() below then
    // records nothing more).
    if (issue_.probed) Wait();
  }
  RingHop(const RingHop&) = delete;
  RingHop& operator=(const RingHop&) = delete;

  // Throws std::runtime_error naming both peers when the transfer fails.
  void Wait() {
    try {
      for (auto& work : works_) {
        if (work) WaitForPeers(work);
      }
      RecordCollective(std::exchange(issue_, CollectiveIssue{}));
    } catch (const std::exception& e) {
      throw std::runtime_error(absl::StrCat(
          "context-parallel peer lost: cp rank ", rank_, " could not send ", what_, " to cp rank ",
          next_, " or receive them from cp rank ", prev_, ": ", c10::GetExceptionString(e)));
    }
    works_.clear();
  }

 private:
  const char* what_;
  int rank_ = 0;
  int next_ = 0;
  int prev_ = 0;
  // Kept alive until the transfer completes.
  std::vector<at::Tensor> outgoing_;
  std::vector<at::Tensor> incoming_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  CollectiveIssue issue_;
};

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t group_handle, int64_t rank, int64_t size,
                            double scale, bool fused_kernel) {
    auto* group = reinterpret_cast<c10d::ProcessGroup*>(group_handle);
    const at::ScalarType acc = AccumulateType(q);
    const int64_t chunk = q.size(2) / 2;
    const std::array<int64_t, 2> query_chunks = ContextParallelChunks(rank, size);
    const at::Tensor q_acc = q.to(acc);
    // k and v packed into one message: [2, batch, kv_heads, local_seq, head_dim].
    at::Tensor held = at::stack({k, v}).to(acc).contiguous();
    at::Tensor out = at::zeros(q.sizes(), q_acc.options());
    at::Tensor lse = at::full({q.size(0), q.size(1), q.size(2)},
                              -std::numeric_limits<double>::infinity(), q_acc.options());
    for (int64_t step = 0; step < size; ++step) {
      std::optional<RingHop> hop;
      at::Tensor arriving;
      if (step + 1 < size) {
        arriving = at::empty_like(held);
        hop.emplace(group, held, arriving, kForwardKvTag, "K/V");
      }
      const int64_t source = (rank - step + size) % size;
      const std::array<int64_t, 2> key_chunks = ContextParallelChunks(source, size);
      const at::Tensor keys = held[0], values = held[1];
      for (int half = 0; half < 2; ++half) {
        const HalfPlan plan = PlanHalf(query_chunks[half], key_chunks, chunk);
        const at::Tensor q_half = q_acc.narrow(2, half * chunk, chunk);
        at::Tensor out_half = out.narrow(2, half * chunk, chunk);
        at::Tensor lse_half = lse.narrow(2, half * chunk, chunk);
        if (plan.full_length > 0) {
          auto [block_out, block_lse] = AttendBlock(
              q_half, keys.narrow(2, plan.full_begin, plan.full_length),
              values.narrow(2, plan.full_begin, plan.full_length), false, scale, fused_kernel);
          MergeBlock(out_half, lse_half, block_out, block_lse);
        }
        if (plan.causal_half >= 0) {
          auto [block_out, block_lse] = AttendBlock(
              q_half, keys.narrow(2, plan.causal_half * chunk, chunk),
              values.narrow(2, plan.causal_half * chunk, chunk), true, scale, fused_kernel);
          MergeBlock(out_half, lse_half, block_out, block_lse);
        }
      }
      if (hop) {
        hop->Wait();
        held = std::move(arriving);
      }
    }
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["group"] = group_handle;
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["size"] = size;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["fused_kernel"] = fused_kernel;
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    auto* group = reinterpret_cast<c10d::ProcessGroup*>(ctx->saved_data["group"].toInt());
    const int64_t rank = ctx->saved_data["rank"].toInt();
    const int64_t size = ctx->saved_data["size"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool fused_kernel = ctx->saved_data["fused_kernel"].toBool();
    const at::ScalarType acc = out.scalar_type();
    const int64_t chunk = q.size(2) / 2;
    const std::array<int64_t, 2> query_chunks = ContextParallelChunks(rank, size);

    const at::Tensor q_acc = q.to(acc);
    const at::Tensor grad_out = grads[0].to(acc);
    const at::Tensor delta = (grad_out * out).sum(-1);
    at::Tensor dq = at::zeros_like(q_acc);
    at::Tensor held = at::stack({k, v}).to(acc).contiguous();
    // The gradient accumulated for the held block; arrives with it from rank - 1 (from step 1
    // on) and leaves with it to rank + 1.
    at::Tensor held_grad;
    std::optional<RingHop> grad_hop;
    at::Tensor grad_arriving;
    for (int64_t step = 0; step < size; ++step) {
      std::optional<RingHop> kv_hop;
      at::Tensor arriving;
      if (step + 1 < size) {
        arriving = at::empty_like(held);
        kv_hop.emplace(group, held, arriving, kBackwardKvTag, "K/V");
      }
      const int64_t source = (rank - step + size) % size;
      const std::array<int64_t, 2> key_chunks = ContextParallelChunks(source, size);
      const at::Tensor keys = held[0], values = held[1];
      at::Tensor block_grad = at::zeros_like(held);  // [2 (dk, dv), batch, kv_heads, seq, d]
      for (int half = 0; half < 2; ++half) {
        const HalfPlan plan = PlanHalf(query_chunks[half], key_chunks, chunk);
        const at::Tensor q_half = q_acc.narrow(2, half * chunk, chunk);
        const at::Tensor grad_half = grad_out.narrow(2, half * chunk, chunk);
        const at::Tensor out_half = out.narrow(2, half * chunk, chunk);
        const at::Tensor lse_half = lse.narrow(2, half * chunk, chunk);
        const at::Tensor delta_half = delta.narrow(2, half * chunk, chunk);
        at::Tensor dq_half = dq.narrow(2, half * chunk, chunk);
        auto add_block = [&](int64_t begin, int64_t length, bool causal) {
          auto [dk, dv] = BackwardBlock(q_half, keys.narrow(2, begin, length),
                                        values.narrow(2, begin, length), grad_half, out_half,
                                        lse_half, delta_half, dq_half, causal, scale, fused_kernel);
          block_grad[0].narrow(2, begin, length).add_(dk);
          block_grad[1].narrow(2, begin, length).add_(dv);
        };
        if (plan.full_length > 0) add_block(plan.full_begin, plan.full_length, false);
        if (plan.causal_half >= 0) add_block(plan.causal_half * chunk, chunk, true);
      }
      if (grad_hop) {
        grad_hop->Wait();
        grad_hop.reset();
        block_grad.add_(grad_arriving);
      }
      held_grad = std::move(block_grad);
      if (size > 1) {
        // After the last step this hop brings each rank its own block's complete gradient.
        grad_arriving = at::empty_like(held_grad);
        grad_hop.emplace(group, held_grad, grad_arriving, kBackwardGradTag, "dK/dV");
      }
      if (kv_hop) {
        kv_hop->Wait();
        held = std::move(arriving);
      }
    }
    if (grad_hop) {
      grad_hop->Wait();
      held_grad = std::move(grad_arriving);
    }
    return {dq.to(q.scalar_type()),
            held_grad[0].to(k.scalar_type()),
            held_grad[1].to(v.scalar_type()),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

absl::Status CheckContextParallelSequence(int64_t seq_len, int cp) {
  if (cp < 1) {
    return absl::InvalidArgumentError(absl::StrCat("context_parallel ", cp, " must be at least 1"));
  }
  if (seq_len <= 0 || seq_len % (2 * static_cast<int64_t>(cp)) != 0) {
    return absl::InvalidArgumentError(SequenceError(seq_len, cp));
  }
  return absl::OkStatus();
}

std::array<int64_t, 2> ContextParallelChunks(int rank, int cp) {
  TORCH_CHECK(rank >= 0 && rank < cp, "context-parallel rank ", rank, " outside 0..", cp - 1);
  return {rank, 2 * static_cast<int64_t>(cp) - 1 - rank};
}

torch::Tensor ContextParallelPositions(int64_t seq_len, int rank, int cp) {
  CheckSequence(seq_len, cp);
  const int64_t chunk = seq_len / (2 * cp);
  std::vector<torch::Tensor> parts;
  for (int64_t index : ContextParallelChunks(rank, cp)) {
    parts.push_back(torch::arange(index * chunk, (index + 1) * chunk, torch::kLong));
  }
  return torch::cat(parts);
}

torch::Tensor ShardForContextParallel(const torch::Tensor& full, int rank, int cp,
                                      int64_t seq_dim) {
  const int64_t dim = c10::maybe_wrap_dim(seq_dim, full.dim());
  CheckSequence(full.size(dim), cp);
  const int64_t chunk = full.size(dim) / (2 * cp);
  std::vector<torch::Tensor> parts;
  for (int64_t index : ContextParallelChunks(rank, cp)) {
    parts.push_back(full.narrow(dim, index * chunk, chunk));
  }
  return torch::cat(parts, dim);
}

torch::Tensor GatherFromContextParallel(const std::vector<torch::Tensor>& shards, int64_t seq_dim) {
  const int cp = static_cast<int>(shards.size());
  TORCH_CHECK(cp >= 1, "no context-parallel shards to gather");
  const int64_t dim = c10::maybe_wrap_dim(seq_dim, shards[0].dim());
  TORCH_CHECK(shards[0].size(dim) % 2 == 0,
              "a context-parallel shard holds two equal chunks, "
              "but its length ",
              shards[0].size(dim), " is odd");
  const int64_t chunk = shards[0].size(dim) / 2;
  std::vector<torch::Tensor> chunks(2 * cp);
  for (int rank = 0; rank < cp; ++rank) {
    TORCH_CHECK(shards[rank].sizes() == shards[0].sizes(), "context-parallel shard ", rank,
                " has shape ", shards[rank].sizes(), ", shard 0 ", shards[0].sizes());
    const std::array<int64_t, 2> indices = ContextParallelChunks(rank, cp);
    for (int half = 0; half < 2; ++half) {
      chunks[indices[half]] = shards[rank].narrow(dim, half * chunk, chunk);
    }
  }
  return torch::cat(chunks, dim);
}

torch::Tensor RingAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const ContextParallel& cp, const RingAttentionOptions& options) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "ring attention takes [batch, heads, local_seq, head_dim] tensors, got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "ring attention: k ", k.sizes(), " and v ", v.sizes(),
              " differ");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
              "ring attention: k ", k.sizes(), " does not match q ", q.sizes(),
              " in batch, local_seq or head_dim");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "ring attention: ", k.size(1),
              " key/value heads do not divide ", q.size(1), " query heads");
  TORCH_CHECK(q.size(2) > 0 && q.size(2) % 2 == 0, "ring attention: local_seq ", q.size(2),
              " must hold two equal chunks (the global seq_len must be divisible by 2 * "
              "context_parallel ",
              2 * cp.size, ")");
  TORCH_CHECK(cp.size == 1 ||
                  (cp.group && cp.group->getSize() == cp.size && cp.group->getRank() == cp.rank),
              "ring attention: context-parallel rank ", cp.rank, " of ", cp.size,
              " needs a process group of that size and rank");
  ContextParallelChunks(cp.rank, cp.size);  // validates the rank
  return RingAttentionFunction::apply(
      q, k, v, reinterpret_cast<int64_t>(cp.group.get()), static_cast<int64_t>(cp.rank),
      static_cast<int64_t>(cp.size),
      options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3)))),
      options.fused_kernel);
}

}  // namespace tessera::trainer
