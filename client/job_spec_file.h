// Job specs for people: YAML (or JSON) files whose keys are the field names
// of tessera.v1.JobSpec, e.g.
//
//   name: tiny-demo
//   model: {preset: tiny-gpt2}
//   data: {train_shards: [/data/train-*.bin], seq_len: 128}
//   batch: {global_batch_size: 16, micro_batch_size: 4}
//   parallelism: auto            # or {layout: {data_parallel: 2, ...}}
//   optimizer: {schedule: {peak_learning_rate: 3e-3, warmup_steps: 10}}
//   max_steps: 200
//   resources: {cpu_slots: 2}
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "tessera/v1/job.pb.h"

namespace tessera::client {

// Parses a spec from YAML or JSON text. INVALID_ARGUMENT naming the field
// (protobuf's JSON mapping) or the YAML line for malformed input.
absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text);

// Reads and parses a spec file; NOT_FOUND naming the path.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);

}  // namespace tessera::client
