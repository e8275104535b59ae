// Fuzz target: job spec files (client/job_spec_file.h), YAML or JSON with ${...} expansion, and
// the coordinator's admission checks and provisional plan (coordinator/admission/job_validation.h)
// of every spec that parses. Inputs are the text of a spec file.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "client/job_spec_file.h"
#include "tests/fuzz/admission_checks.h"

namespace {

// A fixed environment: one variable set, one set but empty, the rest unset.
std::optional<std::string> FakeEnvironment(const std::string& name) {
  if (name == "TESSERA_DATA") return "/data/shards";
  if (name == "EMPTY") return "";
  return std::nullopt;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<tessera::v1::JobSpec> spec = tessera::client::ParseJobSpec(text, FakeEnvironment);
  if (spec.ok()) tessera::fuzz::CheckAdmission(*spec);
  return 0;
}
