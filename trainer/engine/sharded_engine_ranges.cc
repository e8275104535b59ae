// ShardedEngine's side of checkpoints: the tensor ranges this rank saves (its owned range of
// every parameter and of both AdamW moments) and loads into, the names it knows, and AdamW's
// step counter.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "trainer/engine/sharded_engine.h"

namespace tessera::trainer {

void ShardedEngine::AppendRanges(int u, const Entry& entry, int64_t from, int64_t to, bool values,
                                 bool moments, std::vector<TensorRange>* out) {
  if (from >= to) return;
  Unit& unit = units_[u];
  const std::vector<int64_t>& global_shape = model_->ShardOf(entry.name).global_shape;
  for (const ShardPiece& piece : entry.pieces) {
    // The piece's elements in unit coordinates, cut to [from, to).
    const int64_t a = std::max(from, entry.offset + piece.local_begin);
    const int64_t b = std::min(to, entry.offset + piece.local_begin + piece.numel);
    if (a >= b) continue;
    const int64_t offset = a - entry.offset - piece.local_begin;
    auto add = [&](const char* prefix, at::Tensor data) {
      out->push_back({.name = absl::StrCat(prefix, entry.name),
                      .global_shape = global_shape,
                      .offset = offset,
                      .data = std::move(data),
                      .box_offset = piece.box_offset,
                      .box_shape = piece.box_shape});
    };
    if (values) {
      add("model/", stage() == 3 ? unit.owned.narrow(0, a - OwnedBegin(unit), b - a)
                                 : unit.full.narrow(0, a, b - a));
    }
    if (!moments) continue;
    for (const Run& run : runs_) {
      if (run.unit != u || a < run.begin || b > run.end) continue;
      FusedAdamW::State& state = optimizer_->StateFor(run.decay ? 0 : 1, run.state_index);
      add("exp_avg/", state.exp_avg.narrow(0, a - run.begin, b - a));
      add("exp_avg_sq/", state.exp_avg_sq.narrow(0, a - run.begin, b - a));
    }
  }
}

std::vector<TensorRange> ShardedEngine::SaveRanges() {
  std::vector<TensorRange> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = units_[u];
    const int64_t owned_begin = OwnedBegin(unit);
    for (const Entry& entry : unit.entries) {
      if (!entry.saved) continue;
      AppendRanges(static_cast<int>(u), entry, std::max(owned_begin, entry.offset),
                   std::min(owned_begin + unit.shard, entry.offset + entry.numel),
                   /*values=*/true, /*moments=*/true, &out);
    }
  }
  return out;
}

std::vector<TensorRange> ShardedEngine::LoadRanges() {
  std::vector<TensorRange> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = units_[u];
    const int64_t owned_begin = std::min(unit.numel, OwnedBegin(unit));
    const int64_t owned_end = std::min(unit.numel, owned_begin + unit.shard);
    for (const Entry& entry : unit.entries) {
      const int64_t begin = entry.offset, end = entry.offset + entry.numel;
      const int64_t owned_from = std::max(owned_begin, begin), owned_to = std::min(owned_end, end);
      // Parameters: all of them below ZeRO-3. Moments: the range this rank steps.
      AppendRanges(static_cast<int>(u), entry, stage() == 3 ? owned_from : begin,
                   stage() == 3 ? owned_to : end, /*values=*/true, /*moments=*/false, &out);
      AppendRanges(static_cast<int>(u), entry, stage() == 0 ? begin : owned_from,
                   stage() == 0 ? end : owned_to, /*values=*/false, /*moments=*/true, &out);
    }
  }
  return out;
}

bool ShardedEngine::Knows(const std::string& name) const {
  for (const char* prefix : {"model/", "exp_avg/", "exp_avg_sq/"}) {
    if (absl::StartsWith(name, prefix) && names_.contains(name.substr(std::strlen(prefix)))) {
      return true;
    }
  }
  return false;
}

int64_t ShardedEngine::optimizer_step() const {
  if (runs_.empty()) return 0;
  const at::Tensor& step = optimizer_->StateFor(runs_[0].decay ? 0 : 1, runs_[0].state_index).step;
  return static_cast<int64_t>(step.item<double>());
}

void ShardedEngine::set_optimizer_step(int64_t step) {
  for (const Run& run : runs_) {
    optimizer_->StateFor(run.decay ? 0 : 1, run.state_index).step.fill_(static_cast<double>(step));
  }
}

}  // namespace tessera::trainer
