#include "trainer/report/expert_load.h"

#include <algorithm>
#include <numeric>

namespace tessera::trainer {

std::vector<v1::ExpertLoad> ExpertLoads(const std::vector<int64_t>& counts, int layers,
                                        int experts) {
  std::vector<v1::ExpertLoad> loads;
  if (layers <= 0 || experts <= 0 ||
      counts.size() != static_cast<size_t>(layers) * static_cast<size_t>(experts)) {
    return loads;
  }
  loads.reserve(layers);
  for (int layer = 0; layer < layers; ++layer) {
    const auto begin = counts.begin() + static_cast<ptrdiff_t>(layer) * experts;
    const auto end = begin + experts;
    v1::ExpertLoad& load = loads.emplace_back();
    load.set_layer(layer);
    load.mutable_tokens()->Add(begin, end);
    const int64_t total = std::accumulate(begin, end, int64_t{0});
    const int64_t busiest = *std::max_element(begin, end);
    load.set_imbalance(total > 0 ? static_cast<double>(busiest) * experts / total : 0.0);
  }
  return loads;
}

}  // namespace tessera::trainer
