#include "trainer/parallel/context_parallelism.h"

#include "absl/strings/str_cat.h"

namespace tessera::trainer {

absl::Status CheckContextParallelData(bool packed_records, int cp) {
  if (cp <= 1 || !packed_records) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "data.train_shards: the shards pack several records per sample (prepare --pack), which "
      "parallelism.layout.context_parallel ",
      cp, " does not support: ring attention is plainly causal over the whole sample"));
}

ContextParallel ContextParallelOf(const DeviceMesh& mesh) {
  return ContextParallel{.group = mesh.group(MeshDim::kContext),
                         .rank = mesh.coord(MeshDim::kContext),
                         .size = mesh.size(MeshDim::kContext)};
}

std::vector<int64_t> ShardRowsForContextParallel(const std::vector<int64_t>& rows, int64_t seq_len,
                                                 const ContextParallel& cp) {
  if (!cp.enabled()) return rows;
  const int64_t chunk = seq_len / (2 * cp.size);
  TORCH_CHECK(seq_len % (2 * cp.size) == 0 && static_cast<int64_t>(rows.size()) % seq_len == 0,
              "rows of ", rows.size(), " values do not split into sequences of ", seq_len,
              " over context_parallel ", cp.size);
  const std::array<int64_t, 2> chunks = ContextParallelChunks(cp.rank, cp.size);
  std::vector<int64_t> out;
  out.reserve(rows.size() / cp.size);
  for (size_t row = 0; row < rows.size(); row += seq_len) {
    for (int64_t c : chunks) {
      const auto begin = rows.begin() + static_cast<std::ptrdiff_t>(row + c * chunk);
      out.insert(out.end(), begin, begin + chunk);
    }
  }
  return out;
}

}  // namespace tessera::trainer
