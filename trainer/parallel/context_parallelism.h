// Context parallelism applied to a run: what a job must allow for a cp split, this
// rank's ContextParallel on the device mesh (the model is built with it, ModelPartition::cp), and
// the split of a dp rank's token rows into the cp rank's part. Every cp rank of a dp replica reads
// the same samples and keeps the two load-balanced chunks ring_attention.h assigns it (chunks i
// and 2cp-1-i of every sequence); the model then takes each token's global position for its
// position embeddings or rotary angles and attends over the whole sequence with RingAttention.
// The loss of a rank is the mean over its own counted targets, weighed by their share of the
// step's (MicroBatch::loss_tokens is recounted after the split), so that the sum over dp x cp is
// the global token mean; dense gradients are reduced over the dcp group (data_parallelism.h).
//
// Thread safety: plain functions of their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "tessera/v1/layout.pb.h"
#include "tessera/v1/model.pb.h"
#include "trainer/parallel/mesh.h"
#include "trainer/parallel/ring_attention.h"

namespace tessera::trainer {

// INVALID_ARGUMENT naming data.train_shards when the data marks record starts (prepare --pack)
// and cp > 1: ring attention is plainly causal and cannot keep packed records apart.
absl::Status CheckContextParallelData(bool packed_records, int cp);

// This rank's cp group, coordinate and size on the mesh (disabled when cp is 1).
ContextParallel ContextParallelOf(const DeviceMesh& mesh);

// The cp rank's part of `rows` (batch rows of seq_len values each, row-major): per row its two
// chunks, in ShardForContextParallel's order. `rows` is returned as is when cp is disabled.
std::vector<int64_t> ShardRowsForContextParallel(const std::vector<int64_t>& rows, int64_t seq_len,
                                                 const ContextParallel& cp);

}  // namespace tessera::trainer
