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
//
// Values may name environment variables, as in a shell or docker compose:
// ${NAME} (an error naming NAME and its line when unset), ${NAME:-default}
// (default when unset or empty); $$ is a literal $. Only values are expanded,
// never keys or comments.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/job.pb.h"

namespace tessera::client {

// The value of an environment variable, or nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// This process's environment (getenv), for the CLI to pass.
EnvLookup ProcessEnvironment();

// Settings given beside a spec, each PATH=VALUE as `--set` takes them (like
// `helm --set`): PATH is field names joined by dots (optimizer.schedule.
// peak_learning_rate, parallelism.layout.tensor_parallel), VALUE one YAML
// value (3e-3, true, ACTIVATION_CHECKPOINTING_FULL, [a, b], {rank: 8}),
// expanded like the file's values. Applied in order after the file is read, so
// the last setting of a field wins; a mapping missing on the way is created,
// and a value on the way (`parallelism: auto`) is replaced by one.
using SpecSettings = std::vector<std::string>;

// Parses a spec from YAML or JSON text, expanding ${...} in values through
// `env` (none set when null), then applies `settings`. INVALID_ARGUMENT naming
// the field (protobuf's JSON mapping), the variable, the setting, or the YAML
// line for malformed input.
absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text, const EnvLookup& env = nullptr,
                                         const SpecSettings& settings = {});

// Reads and parses a spec file; NOT_FOUND naming the path.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path, const EnvLookup& env = nullptr,
                                        const SpecSettings& settings = {});

// `value` with ${NAME}, ${NAME:-default} and $$ expanded (the rules above).
// INVALID_ARGUMENT naming the variable when one is unset or malformed.
absl::StatusOr<std::string> ExpandEnvironment(const std::string& value, const EnvLookup& env);

}  // namespace tessera::client
