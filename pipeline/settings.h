// The job spec's enumerated settings, each allowed set written once here: its
// kinds, their names in specs, and parsing that names the field and every
// allowed value. The spec is validated with these, and every layer after it
// decides on the kind, never on the string. (schedule.type: ScheduleKind in
// pipeline/schedule.h.)
#ifndef PIPEMARE_PIPELINE_SETTINGS_H_
#define PIPEMARE_PIPELINE_SETTINGS_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pipemare {

// schedule.partition: how the model's units are cut into stages.
enum class PartitionKind { kUniform, kParameters, kProfile, kSplit };
// schedule.transport: how a peer edge's tensor bytes travel.
enum class Transport { kGrpc, kGloo };
// train.on_nonfinite: what a NaN or Inf in a microbatch does.
enum class OnNonFinite { kFail, kSkip };
// schedule.wire_dtype: what activations and gradients travel in.
enum class WireDtype { kFloat32, kFloat16, kBFloat16 };

// The kind named `value`; the default when `value` is empty (uniform, grpc,
// fail). INVALID_ARGUMENT naming the field and the allowed values otherwise.
absl::StatusOr<PartitionKind> ParsePartition(absl::string_view value);
absl::StatusOr<Transport> ParseTransport(absl::string_view value);
absl::StatusOr<OnNonFinite> ParseOnNonFinite(absl::string_view value);
absl::StatusOr<WireDtype> ParseWireDtype(absl::string_view value);

// The names specs use.
const char* PartitionName(PartitionKind kind);
const char* TransportName(Transport transport);
const char* OnNonFiniteName(OnNonFinite policy);
const char* WireDtypeName(WireDtype dtype);

// Of a validated spec (its field's default if it were not).
inline PartitionKind PartitionOf(absl::string_view value) {
  return ParsePartition(value).value_or(PartitionKind::kUniform);
}
inline Transport TransportOf(absl::string_view value) {
  return ParseTransport(value).value_or(Transport::kGrpc);
}
inline OnNonFinite OnNonFiniteOf(absl::string_view value) {
  return ParseOnNonFinite(value).value_or(OnNonFinite::kFail);
}
inline WireDtype WireDtypeOf(absl::string_view value) {
  return ParseWireDtype(value).value_or(WireDtype::kFloat32);
}

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_SETTINGS_H_
