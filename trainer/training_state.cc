#include "trainer/training_state.h"

#include <ATen/CPUGeneratorImpl.h>

namespace tessera::trainer {

void SaveTrainingState(CausalLM& model, const FusedAdamW& optimizer,
                       torch::serialize::OutputArchive& archive) {
  torch::serialize::OutputArchive model_archive, optimizer_archive;
  model->save(model_archive);
  optimizer.Save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("rng_cpu", at::detail::getDefaultCPUGenerator().get_state());
}

void LoadTrainingState(torch::serialize::InputArchive& archive, CausalLM& model,
                       FusedAdamW& optimizer) {
  torch::serialize::InputArchive model_archive, optimizer_archive;
  archive.read("model", model_archive);
  archive.read("optimizer", optimizer_archive);
  model->load(model_archive);
  optimizer.Load(optimizer_archive);
  at::Tensor rng;
  if (archive.try_read("rng_cpu", rng)) {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(rng);
  }
}

}  // namespace tessera::trainer
