// Ring attention on real Gloo groups, ranks simulated by threads sharing a HashStore (c10d's own
// way). Each rank takes its load-balanced chunks of the same global q, k, v and upstream
// gradient; the gathered output and q/k/v gradients must equal full causal attention computed
// explicitly on one rank (softmax of masked scores, kv heads repeated for GQA) with autograd.
#include "trainer/parallel/ring_attention.h"

#include <cmath>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/parallel/collective_timer.h"
#include "trainer/parallel/mesh_threads.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

// Full causal attention, written out: the reference the ring must equal.
torch::Tensor ReferenceAttention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v,
                                 std::optional<double> scale = std::nullopt) {
  const int64_t group = q.size(1) / k.size(1), seq = q.size(2);
  const torch::Tensor keys = k.repeat_interleave(group, 1), values = v.repeat_interleave(group, 1);
  torch::Tensor scores =
      torch::matmul(q, keys.transpose(-1, -2)) * scale.value_or(1.0 / std::sqrt(q.size(3)));
  const torch::Tensor later = torch::ones({seq, seq}, torch::kBool).triu(1);
  scores = scores.masked_fill(later, -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1), values);
}

struct Attention {
  torch::Tensor out, dq, dk, dv;
};

struct Case {
  int cp = 2;
  torch::ScalarType dtype = torch::kDouble;
  int64_t batch = 2, heads = 4, kv_heads = 4, chunk = 3, head_dim = 8;
  double tolerance = 1e-9;
  // Inputs as the model makes them: [batch, seq, heads, head_dim] leaves seen through
  // transpose(1, 2), so q, k and v reach the ring non-contiguous.
  bool model_layout = false;
  // RingAttentionOptions::fused_kernel: LibTorch's CPU flash kernel per block, or explicit.
  bool fused_kernel = true;
  std::optional<double> scale = std::nullopt;
  std::string Name() const {
    const char* type = dtype == torch::kDouble ? "_f64" : dtype == torch::kFloat ? "_f32" : "_bf16";
    return "cp" + std::to_string(cp) + type + "_heads" + std::to_string(heads) + "_kv" +
           std::to_string(kv_heads) + (model_layout ? "_transposed" : "") +
           (fused_kernel ? "" : "_explicit") + (scale ? "_scaled" : "");
  }
};

// gtest names a failing case by this instead of dumping the struct's bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.Name(); }

struct Inputs {
  torch::Tensor q, k, v, grad;
};

Inputs MakeInputs(const Case& c) {
  torch::manual_seed(1234);
  const int64_t seq = 2 * c.cp * c.chunk;
  const auto options = torch::TensorOptions().dtype(torch::kDouble);
  return {torch::randn({c.batch, c.heads, seq, c.head_dim}, options).to(c.dtype),
          torch::randn({c.batch, c.kv_heads, seq, c.head_dim}, options).to(c.dtype),
          torch::randn({c.batch, c.kv_heads, seq, c.head_dim}, options).to(c.dtype),
          torch::randn({c.batch, c.heads, seq, c.head_dim}, options).to(c.dtype)};
}

// In float64 whatever the inputs' dtype, so that lower precisions are measured against the
// exact result of their (rounded) inputs.
Attention RunReference(const Inputs& in, std::optional<double> scale) {
  torch::Tensor q = in.q.to(torch::kDouble).clone().requires_grad_(),
                k = in.k.to(torch::kDouble).clone().requires_grad_(),
                v = in.v.to(torch::kDouble).clone().requires_grad_();
  torch::Tensor out = ReferenceAttention(q, k, v, scale);
  out.backward(in.grad.to(torch::kDouble));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// Every rank's ring attention on its chunks, gathered back into global order.
Attention RunRing(const Inputs& in, int cp, bool model_layout, bool fused_kernel,
                  std::optional<double> scale) {
  std::vector<Attention> per_rank(cp);
  auto run_rank = [&](int rank, const ContextParallel& context) {
    auto shard = [&](const torch::Tensor& full) {
      return ShardForContextParallel(full, rank, cp, /*seq_dim=*/2);
    };
    // The leaf a rank differentiates, and the [batch, heads, seq, head_dim] view of it.
    auto leaf = [&](const torch::Tensor& full) {
      return model_layout ? ShardForContextParallel(full.transpose(1, 2), rank, cp, /*seq_dim=*/1)
                                .requires_grad_()
                          : shard(full).requires_grad_();
    };
    auto heads_view = [&](const torch::Tensor& t) { return model_layout ? t.transpose(1, 2) : t; };
    torch::Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
    EXPECT_EQ(heads_view(q).is_contiguous(), !model_layout);
    torch::Tensor out =
        RingAttention(heads_view(q), heads_view(k), heads_view(v), context,
                      RingAttentionOptions{.scale = scale, .fused_kernel = fused_kernel});
    EXPECT_EQ(out.scalar_type(), in.q.scalar_type());
    out.backward(shard(in.grad));
    per_rank[rank] = {out.detach(), heads_view(q.grad()), heads_view(k.grad()),
                      heads_view(v.grad())};
  };
  if (cp == 1) {
    run_rank(0, ContextParallel{});
  } else {
    testing::RunMeshThreads(MeshShape{.dp = cp},
                            [&](int rank, const JoinedGroup& world, const DeviceMesh&) {
                              run_rank(rank, ContextParallel{world.group, rank, cp});
                            });
  }
  auto gather = [&](torch::Tensor Attention::*field) {
    std::vector<torch::Tensor> shards;
    for (const Attention& a : per_rank) {
      EXPECT_TRUE((a.*field).defined());
      shards.push_back(a.*field);
    }
    return GatherFromContextParallel(shards, /*seq_dim=*/2);
  };
  return {gather(&Attention::out), gather(&Attention::dq), gather(&Attention::dk),
          gather(&Attention::dv)};
}

double MaxDiff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

class RingAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(RingAttentionTest, OutputAndGradientsEqualFullCausalAttention) {
  const Case& c = GetParam();
  const Inputs inputs = MakeInputs(c);
  const Attention expected = RunReference(inputs, c.scale);
  const Attention actual = RunRing(inputs, c.cp, c.model_layout, c.fused_kernel, c.scale);
  EXPECT_LT(MaxDiff(actual.out, expected.out), c.tolerance);
  EXPECT_LT(MaxDiff(actual.dq, expected.dq), c.tolerance);
  EXPECT_LT(MaxDiff(actual.dk, expected.dk), c.tolerance);
  EXPECT_LT(MaxDiff(actual.dv, expected.dv), c.tolerance);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, RingAttentionTest,
    ::testing::Values(
        Case{.cp = 1},  // no ring: the block math alone
        Case{.cp = 2}, Case{.cp = 4}, Case{.cp = 2, .heads = 4, .kv_heads = 2},
        Case{.cp = 4, .heads = 6, .kv_heads = 2, .chunk = 2},
        Case{.cp = 2, .dtype = torch::kFloat, .tolerance = 1e-5},
        Case{.cp = 4,
             .dtype = torch::kFloat,
             .heads = 4,
             .kv_heads = 1,
             .chunk = 4,
             .tolerance = 1e-5},
        // bf16 in and out, accumulated in float32: the error of rounding results of up to ~6
        // to bf16, no more (measured 1.5e-2 on dV).
        Case{.cp = 4, .dtype = torch::kBFloat16, .heads = 4, .kv_heads = 2, .tolerance = 3e-2},
        Case{.cp = 2, .heads = 4, .kv_heads = 2, .model_layout = true}, Case{.cp = 2, .scale = 0.3},
        // The explicit block kernel (what other devices run for now).
        Case{.cp = 1, .fused_kernel = false},
        Case{.cp = 4, .heads = 6, .kv_heads = 2, .chunk = 2, .fused_kernel = false},
        Case{.cp = 2, .heads = 4, .kv_heads = 2, .model_layout = true, .fused_kernel = false},
        Case{.cp = 4,
             .dtype = torch::kFloat,
             .heads = 4,
             .kv_heads = 1,
             .chunk = 4,
             .tolerance = 1e-5,
             .fused_kernel = false},
        Case{.cp = 4,
             .dtype = torch::kBFloat16,
             .heads = 4,
             .kv_heads = 2,
             .tolerance = 3e-2,
             .fused_kernel = false},
        Case{.cp = 2, .fused_kernel = false, .scale = 0.3}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.Name(); });

// With the collective probe on, every hop is preceded by a barrier on the cp group and completes
// before the attention it would overlap: the results are bitwise those of the overlapped ring,
// and each hop's peer wait is recorded beside its transfer.
TEST(RingAttentionProbeTest, ProbedHopsComputeTheSameAndRecordTheirPeerWait) {
  const Case c{.cp = 4};
  const Inputs inputs = MakeInputs(c);
  SetCollectiveTimingEnabled(true);
  const CollectiveTable start = CollectiveSnapshot();
  const Attention overlapped = RunRing(inputs, c.cp, c.model_layout, c.fused_kernel, c.scale);
  SetCollectiveProbeEnabled(true);
  const CollectiveTable before = CollectiveSnapshot();
  const Attention probed = RunRing(inputs, c.cp, c.model_layout, c.fused_kernel, c.scale);
  const CollectiveTable after = CollectiveSnapshot();
  SetCollectiveProbeEnabled(false);
  EXPECT_EQ(MaxDiff(probed.out, overlapped.out), 0.0);
  EXPECT_EQ(MaxDiff(probed.dq, overlapped.dq), 0.0);
  EXPECT_EQ(MaxDiff(probed.dk, overlapped.dk), 0.0);
  EXPECT_EQ(MaxDiff(probed.dv, overlapped.dv), 0.0);
  // RunRing's ranks are a dp-shaped mesh's world group: the hops read dp.
  const int index = CollectiveIndex(CollectiveKind::kSendRecv, static_cast<int>(MeshDim::kData));
  // The same hops, each timed once, and only the probed ones wait in a barrier.
  EXPECT_GT(before[index].calls - start[index].calls, 0);
  EXPECT_EQ(after[index].calls - before[index].calls, before[index].calls - start[index].calls);
  EXPECT_EQ(before[index].peer_wait_nanos, start[index].peer_wait_nanos);
  EXPECT_GT(after[index].peer_wait_nanos, before[index].peer_wait_nanos);
  EXPECT_GT(after[index].nanos, before[index].nanos);
}

TEST(RingAttentionReferenceTest, ReferenceEqualsScaledDotProductAttention) {
  // The explicit reference against LibTorch's own causal attention, so the ring is not merely
  // compared with a copy of its own mistakes.
  torch::manual_seed(7);
  const torch::Tensor q = torch::randn({2, 4, 12, 8}), k = torch::randn({2, 2, 12, 8}),
                      v = torch::randn({2, 2, 12, 8});
  const torch::Tensor sdpa = at::scaled_dot_product_attention(
      q, k, v, std::nullopt, 0.0, /*is_causal=*/true, std::nullopt, /*enable_gqa=*/true);
  EXPECT_LT(MaxDiff(ReferenceAttention(q, k, v), sdpa), 1e-5);
}

TEST(ContextParallelChunksTest, RanksHoldAnEarlyAndALateChunk) {
  // cp 2, seq 8: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_TRUE(ContextParallelPositions(8, 0, 2).equal(torch::tensor({0, 1, 6, 7}, torch::kLong)));
  EXPECT_TRUE(ContextParallelPositions(8, 1, 2).equal(torch::tensor({2, 3, 4, 5}, torch::kLong)));
  // cp 4, seq 8: chunks of 1; rank i holds i and 7 - i.
  EXPECT_TRUE(ContextParallelPositions(8, 2, 4).equal(torch::tensor({2, 5}, torch::kLong)));
  // Every position is held exactly once.
  std::vector<torch::Tensor> all;
  for (int rank = 0; rank < 4; ++rank) all.push_back(ContextParallelPositions(24, rank, 4));
  EXPECT_TRUE(std::get<0>(torch::cat(all).sort()).equal(torch::arange(24, torch::kLong)));
}

TEST(ContextParallelChunksTest, ShardHoldsThePositionsAndGatherInvertsIt) {
  torch::manual_seed(3);
  const int cp = 4;
  const torch::Tensor full = torch::randn({2, 16, 5});  // [batch, seq, hidden]
  std::vector<torch::Tensor> shards;
  for (int rank = 0; rank < cp; ++rank) {
    shards.push_back(ShardForContextParallel(full, rank, cp));
    EXPECT_TRUE(shards.back().equal(full.index_select(1, ContextParallelPositions(16, rank, cp))));
  }
  EXPECT_TRUE(GatherFromContextParallel(shards).equal(full));
  // Another sequence dimension: [batch, heads, seq, head_dim].
  const torch::Tensor heads = torch::randn({2, 3, 8, 4});
  std::vector<torch::Tensor> head_shards;
  for (int rank = 0; rank < 2; ++rank) {
    head_shards.push_back(ShardForContextParallel(heads, rank, 2, /*seq_dim=*/2));
  }
  EXPECT_TRUE(GatherFromContextParallel(head_shards, /*seq_dim=*/2).equal(heads));
}

TEST(ContextParallelChunksTest, ASequenceThatDoesNotSplitIsRejected) {
  EXPECT_THAT(CheckContextParallelSequence(16, 4), IsOk());
  EXPECT_THAT(CheckContextParallelSequence(12, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("seq_len 12 is not divisible by 2 * context_parallel (8)")));
  EXPECT_THAT(CheckContextParallelSequence(16, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("context_parallel 0")));
  try {
    ShardForContextParallel(torch::zeros({1, 10, 2}), 0, 2);
    ADD_FAILURE() << "a sequence of 10 split over cp 2 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("seq_len 10 is not divisible by 2 * context_parallel (4)"));
  }
  EXPECT_THROW(ContextParallelPositions(6, 0, 2), c10::Error);
}

TEST(RingAttentionShapesTest, ShapesThatDoNotFitAreRejected) {
  const torch::Tensor odd = torch::zeros({1, 2, 3, 4});
  try {
    RingAttention(odd, odd, odd, ContextParallel{});
    ADD_FAILURE() << "an odd local sequence was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("local_seq 3 must hold two equal chunks"));
  }
  const torch::Tensor q = torch::zeros({1, 3, 4, 4}), kv = torch::zeros({1, 2, 4, 4});
  EXPECT_THROW(RingAttention(q, kv, kv, ContextParallel{}), c10::Error);
  // A cp of 2 without a group.
  EXPECT_THROW(RingAttention(kv, kv, kv, ContextParallel{.group = {}, .rank = 0, .size = 2}),
               c10::Error);
}

}  // namespace
}  // namespace tessera::trainer
