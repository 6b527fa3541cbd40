// The job spec's enumerated settings, each allowed set written once here: its
// kinds, their names in specs, and parsing that names the field and every
// allowed value. The spec is validated with these, and every layer after it
// decides on the kind, never on the string. (schedule.type: ScheduleKind in
// pipeline/core/schedule.h.)
#ifndef PIPEMARE_PIPELINE_SETTINGS_H_
#define PIPEMARE_PIPELINE_SETTINGS_H_

#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// schedule.partition: how the model's units are cut into stages.
enum class PartitionKind { kUniform, kParameters, kProfile, kSplit };
// schedule.transport: how a peer edge's tensor bytes travel.
enum class Transport { kGrpc, kGloo };
// train.on_nonfinite: what a NaN or Inf in a microbatch does.
enum class OnNonFinite { kFail, kSkip };
// schedule.wire_dtype: what activations and gradients travel in.
enum class WireDtype { kFloat32, kFloat16, kBFloat16 };
// model.type: the model's family (required).
enum class ModelKind { kMlp, kResNet, kTransformerLm, kSequential, kTorchScript };
// data.type: the dataset's format (required).
enum class DataKind { kIdx, kMnist, kCifar, kText };
// optimizer.type.
enum class OptimizerKind { kSgd, kAdam, kAdamW };
// optimizer.lr_schedule: the base learning rate over the steps
// (pipeline/core/lr_schedule.h).
enum class LrScheduleKind { kConstant, kCosine, kStep };
// What the job learns, from its data (DataInfo.task: next-token prediction
// for text, classification otherwise); JobStatus.task names it.
enum class Task { kClassification, kLanguageModel };

// The kind named `value`; the default when `value` is empty (uniform, grpc,
// fail). INVALID_ARGUMENT naming the field and the allowed values otherwise.
absl::StatusOr<PartitionKind> ParsePartition(absl::string_view value);
absl::StatusOr<Transport> ParseTransport(absl::string_view value);
absl::StatusOr<OnNonFinite> ParseOnNonFinite(absl::string_view value);
absl::StatusOr<WireDtype> ParseWireDtype(absl::string_view value);
absl::StatusOr<OptimizerKind> ParseOptimizer(absl::string_view value);
absl::StatusOr<LrScheduleKind> ParseLrSchedule(absl::string_view value);
// Required: an empty value is INVALID_ARGUMENT ("required; allowed: ...").
absl::StatusOr<ModelKind> ParseModelKind(absl::string_view value);
absl::StatusOr<DataKind> ParseDataKind(absl::string_view value);
// JobStatus.task as the coordinator wrote it (classification when empty).
absl::StatusOr<Task> ParseTask(absl::string_view value);

// The names specs use.
const char* PartitionName(PartitionKind kind);
const char* TransportName(Transport transport);
const char* OnNonFiniteName(OnNonFinite policy);
const char* WireDtypeName(WireDtype dtype);
const char* ModelKindName(ModelKind kind);
const char* DataKindName(DataKind kind);
const char* OptimizerName(OptimizerKind kind);
const char* LrScheduleName(LrScheduleKind kind);
const char* TaskName(Task task);

// The wire dtype activations and gradients travel as between two stages under
// `dtype` (the torch side: stage_worker/tensor_wire.h).
v1::DType PeerDType(WireDtype dtype);

// Of a validated spec (the field's default if it were not; code that may see
// an unvalidated spec parses).
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
// Model and data have no default: nullopt for a value that is not one, which
// compares unequal to every kind.
inline std::optional<ModelKind> ModelKindOf(absl::string_view value) {
  auto kind = ParseModelKind(value);
  return kind.ok() ? std::optional<ModelKind>(*kind) : std::nullopt;
}
inline std::optional<DataKind> DataKindOf(absl::string_view value) {
  auto kind = ParseDataKind(value);
  return kind.ok() ? std::optional<DataKind>(*kind) : std::nullopt;
}
inline OptimizerKind OptimizerOf(absl::string_view value) {
  return ParseOptimizer(value).value_or(OptimizerKind::kSgd);
}
inline LrScheduleKind LrScheduleOf(absl::string_view value) {
  return ParseLrSchedule(value).value_or(LrScheduleKind::kConstant);
}
// idx and mnist are both idx files (mnist adds its normalisation and names).
inline bool IsIdx(DataKind kind) { return kind == DataKind::kIdx || kind == DataKind::kMnist; }

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_SETTINGS_H_
