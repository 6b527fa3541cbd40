// Fuzzes the job-spec parser (pipeline/core/job_spec.h), YAML and JSON alike: a
// spec that parses gets its defaults and is validated, as the client and the
// coordinator do at submit. Nothing here opens files.
#include <cstddef>
#include <cstdint>
#include <string>

#include "pipeline/core/job_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto spec = pipemare::ParseJobSpec(std::string(reinterpret_cast<const char*>(data), size));
  if (!spec.ok()) return 0;
  pipemare::ApplyJobSpecDefaults(*spec);
  (void)pipemare::ValidateJobSpec(*spec);
  return 0;
}
