// Fuzz target: the coordinator's admission checks and provisional plan (coordinator/
// job_validation.h) of a JobSpec as SubmitJob receives it, i.e. a binary proto from any client,
// reaching values (NaN, negative sizes, huge counts) that a spec file's JSON mapping may not.
// Inputs are serialized tessera.v1.JobSpec messages.
#include <cstddef>
#include <cstdint>

#include "tessera/v1/job.pb.h"
#include "tests/fuzz/admission_checks.h"
#include "tests/fuzz/protobuf_logs.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  tessera::fuzz::SilenceProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tessera::v1::JobSpec spec;
  if (spec.ParseFromArray(data, static_cast<int>(size))) tessera::fuzz::CheckAdmission(spec);
  return 0;
}
