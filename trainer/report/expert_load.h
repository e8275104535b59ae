// A mixture-of-experts step's routing as reported (StepMetrics.expert_load): each layer's token
// slots per expert and its imbalance, from the router's counts. Plain C++: the training loop
// copies the counts off the device and calls this.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/v1/metrics.pb.h"

namespace tessera::trainer {

// One ExpertLoad per row of `counts`, a row-major [layers, experts] array of token slots
// (layers * experts values): layer = the row's index, tokens = the row, imbalance = the row's
// maximum over its mean (1 for an even split; 0 for a row without a slot). Rows of layers that
// are not mixtures of experts are left out by the caller.
std::vector<v1::ExpertLoad> ExpertLoads(const std::vector<int64_t>& counts, int layers,
                                        int experts);

}  // namespace tessera::trainer
