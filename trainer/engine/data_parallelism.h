// Data parallelism applied to a run: dp rank 0's weights made authoritative over the mesh's dcp
// group (dp x cp, the ranks holding the same dense parameters; the dp group without context
// parallelism), as DDP's broadcast does, and the ZeRO engine (sharded_engine.h) that reduces
// gradients over that group, shards the optimizer state (and, at ZeRO-3, the parameters) and
// steps AdamW. Its "dp" options are that group's: with cp > 1 the data is still dealt by the dp
// coordinate alone (each cp rank keeps its part of every sequence, context_parallelism.h).
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

// Broadcasts the trainable parameters of dcp rank 0 to the other ranks of its dcp group (nothing
// without one). Frozen parameters (LoRA's base) are skipped: every rank loads or draws the same.
void BroadcastFromFirstDataRank(CausalLMImpl& model, const DeviceMesh& mesh);

// The ZeRO engine of `model` on `mesh`: `options` with its mesh fields (the dcp group, rank and
// size as its dp ones, the pipeline group, stage and size) filled from `mesh`, and reduce-scatters and
// all-gathers run as all-reduces off CUDA
// (ShardedEngineOptions::sharded_collectives_as_all_reduce).
std::unique_ptr<ShardedEngine> ApplyDataParallel(CausalLM model, const DeviceMesh& mesh,
                                                 ShardedEngineOptions options);

}  // namespace tessera::trainer
