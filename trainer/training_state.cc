#include "trainer/training_state.h"

#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace tessera::trainer {
namespace {

constexpr char kStepName[] = "optimizer.step";

std::string RngName(int rank) { return absl::StrFormat("rng/cpu/rank-%05d", rank); }

}  // namespace

absl::StatusOr<WrittenShard> WriteTrainingState(
    const std::string& path, ShardedEngine& engine, int rank,
    const std::map<std::string, std::string>& metadata) {
  std::vector<TensorRange> ranges = engine.SaveRanges();
  // Shard files are written from host memory; keep the CPU copies alive until then.
  std::vector<at::Tensor> host;
  std::vector<SliceToWrite> slices;
  host.reserve(ranges.size() + 2);
  slices.reserve(ranges.size() + 2);
  for (const TensorRange& range : ranges) {
    host.push_back(range.data.to(at::kCPU).contiguous());
    slices.push_back({.name = range.name,
                      .dtype = "F32",
                      .global_shape = range.global_shape,
                      .offset = range.offset,
                      .numel = host.back().numel(),
                      .data = host.back().data_ptr(),
                      .box_offset = range.box_offset,
                      .box_shape = range.box_shape});
  }
  int64_t step = engine.optimizer_step();
  if (rank == 0) {
    slices.push_back({.name = kStepName, .dtype = "I64", .numel = 1, .data = &step});
  }
  host.push_back(at::detail::getDefaultCPUGenerator().get_state().contiguous());
  slices.push_back({.name = RngName(rank),
                    .dtype = "U8",
                    .global_shape = {host.back().numel()},
                    .numel = host.back().numel(),
                    .data = host.back().data_ptr()});
  return WriteShardFile(path, slices, metadata);
}

absl::Status ReadTrainingState(const ShardedCheckpointReader& reader, ShardedEngine& engine,
                               int rank) {
  for (const TensorRange& range : engine.LoadRanges()) {
    at::Tensor host = at::empty({range.data.numel()}, at::kFloat);
    RETURN_IF_ERROR(reader.Read(range.name, range.global_shape, "F32", range.box_offset,
                                range.box_shape, range.offset, host.numel(), host.data_ptr()));
    torch::NoGradGuard no_grad;
    range.data.copy_(host);
  }
  for (const std::string& name : reader.TensorNames()) {
    const bool model_state = absl::StartsWith(name, "model/") || absl::StartsWith(name, "exp_avg");
    if (model_state && !engine.Knows(name)) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint tensor ", name,
                       " is not in this model: the checkpoint is from another model"));
    }
  }
  int64_t step = 0;
  RETURN_IF_ERROR(reader.Read(kStepName, {}, "I64", 0, 1, &step));
  engine.set_optimizer_step(step);
  const std::string rng = reader.Has(RngName(rank)) ? RngName(rank) : RngName(0);
  if (reader.Has(rng)) {
    ASSIGN_OR_RETURN(std::vector<int64_t> shape, reader.GlobalShape(rng));
    at::Tensor state = at::empty({shape.at(0)}, at::kByte);
    RETURN_IF_ERROR(reader.Read(rng, shape, "U8", 0, state.numel(), state.data_ptr()));
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(state);
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer
