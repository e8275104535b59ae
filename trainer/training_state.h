// What a checkpoint shard holds: the model's parameters and buffers ("model"), the AdamW moments
// and step counters ("optimizer") and the CPU generator's state ("rng_cpu"), in one LibTorch
// archive. The trainer's save and resume, and the checkpoint benchmark, all go through here.
#pragma once

#include <torch/serialize/archive.h>

#include "trainer/adamw.h"
#include "trainer/model.h"

namespace tessera::trainer {

// Writes the training state into `archive`.
void SaveTrainingState(CausalLM& model, const FusedAdamW& optimizer,
                       torch::serialize::OutputArchive& archive);

// Restores it from `archive` (the RNG only when the archive has it). Throws c10::Error when the
// archive does not match the model or optimizer.
void LoadTrainingState(torch::serialize::InputArchive& archive, CausalLM& model,
                       FusedAdamW& optimizer);

}  // namespace tessera::trainer
