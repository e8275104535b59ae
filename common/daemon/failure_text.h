// How a trainer failure reads to people, in one line: "rank 1 on n1 was killed by signal 9
// (SIGKILL) at step 32", "node n2 was lost: no heartbeat for 5.2s", "rank 0 on n1 failed at step
// 7: NAN_LOSS: loss is nan". Shared by the coordinator (job reasons) and the CLI (watch).
// Thread-safe.
#pragma once

#include <string>

#include "tessera/v1/metrics.pb.h"

namespace tessera {

std::string DescribeFailure(const v1::TrainerFailure& failure);

}  // namespace tessera
