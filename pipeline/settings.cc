#include "pipeline/settings.h"

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

template <typename Kind, size_t N>
absl::StatusOr<Kind> Parse(const char* field, absl::string_view value,
                           const Allowed<Kind> (&allowed)[N]) {
  if (value.empty()) return allowed[0].kind;
  std::string names;
  for (const Allowed<Kind>& a : allowed) {
    if (value == a.name) return a.kind;
    absl::StrAppend(&names, names.empty() ? "" : ", ", a.name, a.note);
  }
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
const char* PartitionName(PartitionKind kind) { return Name(kind, kPartitions); }
const char* TransportName(Transport transport) { return Name(transport, kTransports); }
const char* OnNonFiniteName(OnNonFinite policy) { return Name(policy, kOnNonFinite); }
const char* WireDtypeName(WireDtype dtype) { return Name(dtype, kWireDtypes); }

}  // namespace pipemare
