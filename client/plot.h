// Renders a job's training curves as a self-contained SVG: loss (training
// line, evaluation points) above throughput, against the optimizer step, with
// axes and gridlines, for reports and pull requests.
#pragma once

#include <string>

#include "tessera/v1/coordinator_service.pb.h"

namespace tessera::client {

// The SVG document (UTF-8). Works for any number of points, zero included.
std::string RenderTrainingPlot(const std::string& title, const v1::GetMetricsResponse& metrics);

}  // namespace tessera::client
