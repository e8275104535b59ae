// Data parallelism applied to a run: dp rank 0's weights made authoritative over the mesh's dp
// group (as DDP's broadcast does), and the ZeRO engine (sharded_engine.h) that reduces gradients
// over that group, shards the optimizer state (and, at ZeRO-3, the parameters) and steps AdamW.
// The engine is the last parallelism applied: it takes over the model's trainable parameters.
//
// Thread safety: plain functions; both are collectives over the mesh's dp group when it has one,
// called by every rank of the group in the same order.
#pragma once

#include <memory>

#include "trainer/engine/sharded_engine.h"
#include "trainer/model/model.h"
#include "trainer/parallel/mesh.h"

namespace tessera::trainer {

// Broadcasts the trainable parameters of dp rank 0 to the other ranks of its dp group (nothing
// without one). Frozen parameters (LoRA's base) are skipped: every rank loads or draws the same.
void BroadcastFromFirstDataRank(CausalLMImpl& model, const DeviceMesh& mesh);

// The ZeRO engine of `model` on `mesh`: `options` with its mesh fields (the dp group, rank and
// size, the pipeline group, stage and size) filled from `mesh`, and reduce-scatters and
// all-gathers run as all-reduces off CUDA
// (ShardedEngineOptions::sharded_collectives_as_all_reduce).
std::unique_ptr<ShardedEngine> ApplyDataParallel(CausalLM model, const DeviceMesh& mesh,
                                                 ShardedEngineOptions options);

}  // namespace tessera::trainer
