#include "pipeline/core/settings.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace pipemare {
namespace {

// One allowed value: its kind, its name, and what the error adds after it.
template <typename Kind>
struct Allowed {
  Kind kind;
  const char* name;
  const char* note;
};

// The first entry is the default.
constexpr Allowed<PartitionKind> kPartitions[] = {
    {PartitionKind::kUniform, "uniform", " (default)"},
    {PartitionKind::kParameters, "parameters", ""},
    {PartitionKind::kProfile, "profile", ""},
    {PartitionKind::kSplit, "split", ""}};
constexpr Allowed<Transport> kTransports[] = {{Transport::kGrpc, "grpc", " (default)"},
                                              {Transport::kGloo, "gloo", ""}};
constexpr Allowed<OnNonFinite> kOnNonFinite[] = {
    {OnNonFinite::kFail, "fail", " (the default: the job fails)"},
    {OnNonFinite::kSkip, "skip", " (drop the microbatch)"}};
constexpr Allowed<WireDtype> kWireDtypes[] = {{WireDtype::kFloat32, "float32", " (default)"},
                                              {WireDtype::kFloat16, "float16", ""},
                                              {WireDtype::kBFloat16, "bfloat16", ""}};

// Sets without a default: an empty value is an error.
constexpr Allowed<ModelKind> kModelKinds[] = {{ModelKind::kMlp, "mlp", ""},
                                              {ModelKind::kResNet, "resnet", ""},
                                              {ModelKind::kTransformerLm, "transformer_lm", ""},
                                              {ModelKind::kSequential, "sequential", ""},
                                              {ModelKind::kTorchScript, "torchscript", ""}};
constexpr Allowed<DataKind> kDataKinds[] = {{DataKind::kIdx, "idx", ""},
                                            {DataKind::kMnist, "mnist", ""},
                                            {DataKind::kCifar, "cifar", ""},
                                            {DataKind::kText, "text", ""}};
// The first entry is the default again.
constexpr Allowed<OptimizerKind> kOptimizers[] = {{OptimizerKind::kSgd, "sgd", " (default)"},
                                                  {OptimizerKind::kAdam, "adam", ""},
                                                  {OptimizerKind::kAdamW, "adamw", ""}};
constexpr Allowed<LrScheduleKind> kLrSchedules[] = {
    {LrScheduleKind::kConstant, "constant", " (default)"},
    {LrScheduleKind::kCosine, "cosine", ""},
    {LrScheduleKind::kStep, "step", ""}};
constexpr Allowed<Task> kTasks[] = {{Task::kClassification, "classification", " (default)"},
                                    {Task::kLanguageModel, "language_model", ""}};

template <typename Kind, size_t N>
absl::StatusOr<Kind> Parse(const char* field, absl::string_view value,
                           const Allowed<Kind> (&allowed)[N], bool required = false) {
  if (value.empty() && !required) return allowed[0].kind;
  std::string names;
  for (const Allowed<Kind>& a : allowed) {
    if (!value.empty() && value == a.name) return a.kind;
    absl::StrAppend(&names, names.empty() ? "" : ", ", a.name, a.note);
  }
  if (value.empty())
    return absl::InvalidArgumentError(absl::StrCat(field, ": required; allowed: ", names));
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": '", value, "' is not allowed; allowed: ", names));
}

template <typename Kind, size_t N>
const char* Name(Kind kind, const Allowed<Kind> (&allowed)[N]) {
  for (const Allowed<Kind>& a : allowed) {
    if (a.kind == kind) return a.name;
  }
  return allowed[0].name;
}

}  // namespace

absl::StatusOr<PartitionKind> ParsePartition(absl::string_view value) {
  return Parse("schedule.partition", value, kPartitions);
}
absl::StatusOr<Transport> ParseTransport(absl::string_view value) {
  return Parse("schedule.transport", value, kTransports);
}
absl::StatusOr<OnNonFinite> ParseOnNonFinite(absl::string_view value) {
  return Parse("train.on_nonfinite", value, kOnNonFinite);
}
absl::StatusOr<WireDtype> ParseWireDtype(absl::string_view value) {
  return Parse("schedule.wire_dtype", value, kWireDtypes);
}
absl::StatusOr<OptimizerKind> ParseOptimizer(absl::string_view value) {
  return Parse("optimizer.type", value, kOptimizers);
}
absl::StatusOr<LrScheduleKind> ParseLrSchedule(absl::string_view value) {
  return Parse("optimizer.lr_schedule", value, kLrSchedules);
}
absl::StatusOr<ModelKind> ParseModelKind(absl::string_view value) {
  return Parse("model.type", value, kModelKinds, /*required=*/true);
}
absl::StatusOr<DataKind> ParseDataKind(absl::string_view value) {
  return Parse("data.type", value, kDataKinds, /*required=*/true);
}
absl::StatusOr<Task> ParseTask(absl::string_view value) { return Parse("task", value, kTasks); }
const char* ModelKindName(ModelKind kind) { return Name(kind, kModelKinds); }
const char* DataKindName(DataKind kind) { return Name(kind, kDataKinds); }
const char* OptimizerName(OptimizerKind kind) { return Name(kind, kOptimizers); }
const char* LrScheduleName(LrScheduleKind kind) { return Name(kind, kLrSchedules); }
const char* TaskName(Task task) { return Name(task, kTasks); }
const char* PartitionName(PartitionKind kind) { return Name(kind, kPartitions); }
const char* TransportName(Transport transport) { return Name(transport, kTransports); }
const char* OnNonFiniteName(OnNonFinite policy) { return Name(policy, kOnNonFinite); }
const char* WireDtypeName(WireDtype dtype) { return Name(dtype, kWireDtypes); }

v1::DType PeerDType(WireDtype dtype) {
  switch (dtype) {
    case WireDtype::kFloat16:
      return v1::FLOAT16;
    case WireDtype::kBFloat16:
      return v1::BFLOAT16;
    case WireDtype::kFloat32:
      break;
  }
  return v1::FLOAT32;
}

}  // namespace pipemare
