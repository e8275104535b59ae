// Job specs the control-plane tests submit: small, valid, and cheap to plan. Header-only, so the
// test utility library needs no proto dependency; include it from targets that link
// tessera::proto.
#pragma once

#include <string>

#include "tessera/v1/job.pb.h"

namespace tessera::testing {

// A valid spec: tiny-gpt2 on CPU slots, 100 steps, shards at /data/train-*.bin (never read by
// tests that only drive the control plane).
inline v1::JobSpec TinyCpuJobSpec(const std::string& name, int cpu_slots = 2,
                                  int max_restarts = 0) {
  v1::JobSpec spec;
  spec.set_name(name);
  spec.mutable_model()->set_preset("tiny-gpt2");
  spec.mutable_data()->add_train_shards("/data/train-*.bin");
  spec.mutable_data()->set_seq_len(64);
  spec.mutable_batch()->set_global_batch_size(8);
  spec.mutable_batch()->set_micro_batch_size(2);
  spec.mutable_optimizer()->mutable_schedule()->set_peak_learning_rate(1e-3);
  spec.set_max_steps(100);
  spec.mutable_resources()->set_cpu_slots(cpu_slots);
  spec.set_max_restarts(max_restarts);
  return spec;
}

}  // namespace tessera::testing
