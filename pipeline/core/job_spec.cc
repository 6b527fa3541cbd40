#include "pipeline/core/job_spec.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "pipeline/core/partition.h"
#include "pipeline/core/schedule.h"
#include "pipeline/core/settings.h"

namespace pipemare {
namespace {

namespace pb = google::protobuf;
using FD = pb::FieldDescriptor;

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

std::string FieldNames(const pb::Descriptor* d) {
  std::vector<std::string> names;
  for (int i = 0; i < d->field_count(); ++i) names.push_back(d->field(i)->name());
  return absl::StrJoin(names, ", ");
}

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

std::string Shown(const YAML::Node& node) {
  if (node.IsScalar()) return absl::StrCat("'", node.Scalar(), "'");
  if (node.IsSequence()) return "a list";
  if (node.IsMap()) return "a mapping";
  return "nothing";
}

const char* TypeWord(const FD* f) {
  switch (f->cpp_type()) {
    case FD::CPPTYPE_INT32:
    case FD::CPPTYPE_INT64:
    case FD::CPPTYPE_UINT32:
    case FD::CPPTYPE_UINT64:
      return "an integer";
    case FD::CPPTYPE_DOUBLE:
    case FD::CPPTYPE_FLOAT:
      return "a number";
    case FD::CPPTYPE_BOOL:
      return "true or false";
    case FD::CPPTYPE_STRING:
      return "a string";
    case FD::CPPTYPE_MESSAGE:
      return "a mapping";
    default:
      return "a value";
  }
}

// Parses one scalar into an int64/double/bool, refusing anything else.
bool ToInt(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  size_t pos = 0;
  try {
    long long v = std::stoll(s, &pos, 10);
    if (pos != s.size()) return false;
    *out = v;
    return true;
  } catch (...) {
    return false;
  }
}
bool ToDouble(const std::string& s, double* out) {
  if (s.empty()) return false;
  size_t pos = 0;
  try {
    double v = std::stod(s, &pos);
    if (pos != s.size() || !std::isfinite(v)) return false;
    *out = v;
    return true;
  } catch (...) {
    return false;
  }
}
bool ToBool(const std::string& s, bool* out) {
  if (s == "true" || s == "True" || s == "yes") return *out = true, true;
  if (s == "false" || s == "False" || s == "no") return *out = false, true;
  return false;
}

absl::Status SetScalar(pb::Message& msg, const FD* f, const YAML::Node& node,
                       const std::string& path) {
  const pb::Reflection* r = msg.GetReflection();
  if (!node.IsScalar()) {
    return Bad(path, absl::StrCat("expected ", TypeWord(f), ", got ", Shown(node)));
  }
  const std::string& s = node.Scalar();
  auto type_error = [&] {
    return Bad(path, absl::StrCat("expected ", TypeWord(f), ", got '", s, "'"));
  };
  const bool repeated = f->is_repeated();
  switch (f->cpp_type()) {
    case FD::CPPTYPE_INT32:
    case FD::CPPTYPE_INT64: {
      int64_t v;
      if (!ToInt(s, &v)) return type_error();
      if (f->cpp_type() == FD::CPPTYPE_INT32) {
        if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
          return Bad(path, absl::StrCat("'", s, "' is out of range"));
        }
        repeated ? r->AddInt32(&msg, f, v) : r->SetInt32(&msg, f, v);
      } else {
        repeated ? r->AddInt64(&msg, f, v) : r->SetInt64(&msg, f, v);
      }
      return absl::OkStatus();
    }
    case FD::CPPTYPE_DOUBLE: {
      double v;
      if (!ToDouble(s, &v)) return type_error();
      repeated ? r->AddDouble(&msg, f, v) : r->SetDouble(&msg, f, v);
      return absl::OkStatus();
    }
    case FD::CPPTYPE_BOOL: {
      bool v;
      if (!ToBool(s, &v)) return type_error();
      repeated ? r->AddBool(&msg, f, v) : r->SetBool(&msg, f, v);
      return absl::OkStatus();
    }
    case FD::CPPTYPE_STRING:
      repeated ? r->AddString(&msg, f, s) : r->SetString(&msg, f, s);
      return absl::OkStatus();
    default:
      return Bad(path, "field type not supported in spec files");
  }
}

absl::Status FillMessage(pb::Message& msg, const YAML::Node& node, const std::string& path) {
  const pb::Descriptor* d = msg.GetDescriptor();
  if (!node.IsMap()) {
    return Bad(path.empty() ? "spec" : path, absl::StrCat("expected a mapping with fields (",
                                                          FieldNames(d), "), got ", Shown(node)));
  }
  const pb::Reflection* r = msg.GetReflection();
  std::set<std::string> seen;
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    const std::string field_path = Join(path, key);
    const FD* f = d->FindFieldByName(key);
    if (f == nullptr) {
      return Bad(field_path, absl::StrCat("unknown field; allowed here: ", FieldNames(d)));
    }
    // YAML keeps the last of two equal keys; the first one's settings would
    // be lost without a word.
    if (!seen.insert(key).second) {
      return Bad(field_path, "given twice in the same mapping; keep one");
    }
    const YAML::Node& value = kv.second;
    if (value.IsNull()) continue;  // "field:" with nothing = unset
    // 0 reads as "unset" for these (the default applies): refuse it.
    for (const auto& [zero_path, range, fallback] :
         std::vector<std::tuple<const char*, const char*, const char*>>{
             {"schedule.microbatch_size", "1..65536", "64"},
             {"schedule.microbatches_per_step", "1..4096", "1"},
             {"checkpoint.keep", "1..1000", "3"}}) {
      if (field_path == zero_path && value.IsScalar() && value.Scalar() == "0") {
        return Bad(field_path, absl::StrCat("0 is out of range: use ", range,
                                            ", or leave it out for the default ", fallback));
      }
    }
    if (f->is_repeated()) {
      if (!value.IsSequence()) {
        return Bad(field_path,
                   absl::StrCat("expected a list (each ", TypeWord(f), "), got ", Shown(value)));
      }
      r->ClearField(&msg, f);
      for (size_t i = 0; i < value.size(); ++i) {
        const std::string item = absl::StrCat(field_path, "[", i, "]");
        auto st = f->cpp_type() == FD::CPPTYPE_MESSAGE
                      ? FillMessage(*r->AddMessage(&msg, f), value[i], item)
                      : SetScalar(msg, f, value[i], item);
        if (!st.ok()) return st;
      }
    } else if (f->cpp_type() == FD::CPPTYPE_MESSAGE) {
      auto st = FillMessage(*r->MutableMessage(&msg, f), value, field_path);
      if (!st.ok()) return st;
    } else {
      auto st = SetScalar(msg, f, value, field_path);
      if (!st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

absl::Status OneOf(const std::string& path, const std::string& value,
                   const std::vector<std::string>& allowed) {
  for (const auto& a : allowed) {
    if (value == a) return absl::OkStatus();
  }
  if (value.empty()) {
    return Bad(path, absl::StrCat("required; allowed: ", absl::StrJoin(allowed, ", ")));
  }
  return Bad(path,
             absl::StrCat("'", value, "' is not allowed; allowed: ", absl::StrJoin(allowed, ", ")));
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("spec is not valid YAML/JSON: line ",
                                                   e.mark.line + 1, ", column ", e.mark.column + 1,
                                                   ": ", e.msg));
  }
  v1::JobSpec spec;
  if (root.IsNull()) return absl::InvalidArgumentError("spec: the document is empty");
  try {
    auto st = FillMessage(spec, root, "");
    if (!st.ok()) return st;
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("spec: ", e.msg));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> LoadJobSpecFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is a directory; give the spec file (YAML or JSON) in it"));
  }
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open spec file '", path, "'"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  auto spec = ParseJobSpec(ss.str());
  if (!spec.ok()) {
    return absl::Status(spec.status().code(), absl::StrCat(path, ": ", spec.status().message()));
  }
  return spec;
}

void ApplyJobSpecDefaults(v1::JobSpec& spec) {
  if (spec.model().activation().empty()) spec.mutable_model()->set_activation("relu");
  if (spec.model().init().empty()) spec.mutable_model()->set_init("torch");
  if (spec.optimizer().type().empty()) {
    spec.mutable_optimizer()->set_type(OptimizerName(OptimizerKind::kSgd));
  }
  if (spec.optimizer().lr_schedule().empty()) {
    spec.mutable_optimizer()->set_lr_schedule(LrScheduleName(LrScheduleKind::kConstant));
  }
  auto* s = spec.mutable_schedule();
  if (s->microbatch_size() == 0) s->set_microbatch_size(64);
  if (s->microbatches_per_step() == 0) s->set_microbatches_per_step(1);
  if (!spec.train().has_shuffle()) spec.mutable_train()->set_shuffle(true);
  if (spec.train().on_nonfinite().empty()) {
    spec.mutable_train()->set_on_nonfinite(OnNonFiniteName(OnNonFinite::kFail));
  }
  if (spec.checkpoint().keep() == 0) spec.mutable_checkpoint()->set_keep(3);
  auto* r = spec.mutable_recovery();
  if (!r->has_max_restarts()) r->set_max_restarts(3);
  if (!r->has_wait_seconds()) r->set_wait_seconds(60);
}

const std::vector<std::string>& LayerTypes() {
  static const std::vector<std::string> kTypes = {"linear",
                                                  "conv2d",
                                                  "batchnorm2d",
                                                  "layernorm",
                                                  "relu",
                                                  "gelu",
                                                  "tanh",
                                                  "sigmoid",
                                                  "maxpool2d",
                                                  "avgpool2d",
                                                  "adaptive_avgpool2d",
                                                  "flatten",
                                                  "dropout",
                                                  "embedding",
                                                  "residual",
                                                  "transformer_block"};
  return kTypes;
}

int ModelUnitCount(const v1::ModelSpec& model) {
  auto kind = ParseModelKind(model.type());
  if (!kind.ok()) return 0;
  switch (*kind) {
    case ModelKind::kMlp:
      return std::max(0, model.layers_size() - 1);
    case ModelKind::kResNet: {  // stem, 3n blocks, head
      const int depth = model.depth() ? model.depth() : 20;
      return depth >= 8 ? (depth - 2) / 6 * 3 + 2 : 0;
    }
    case ModelKind::kTransformerLm:  // embedding, blocks, norm and head
      return (model.depth() ? model.depth() : 2) + 2;
    case ModelKind::kSequential:
      return model.units_size();
    case ModelKind::kTorchScript:
      return 0;  // known once the file is read
  }
  return 0;
}

namespace {

absl::Status ValidateUnits(const pb::RepeatedPtrField<v1::UnitSpec>& units,
                           const std::string& field) {
  for (int i = 0; i < units.size(); ++i) {
    const v1::UnitSpec& u = units[i];
    const std::string f = absl::StrCat(field, "[", i, "]");
    const auto& types = LayerTypes();
    if (std::find(types.begin(), types.end(), u.type()) == types.end()) {
      return Bad(
          absl::StrCat(f, ".type"),
          absl::StrCat(
              u.type().empty() ? "required" : absl::StrCat("'", u.type(), "' is not a layer type"),
              "; allowed: ", absl::StrJoin(types, ", ")));
    }
    if (u.type() != "residual" && u.body_size() > 0) {
      return Bad(absl::StrCat(f, ".body"), "only a residual unit has a body");
    }
    if (u.type() == "residual") {
      if (u.body_size() == 0) {
        return Bad(absl::StrCat(f, ".body"), "required: the branch's layers, at least one");
      }
      if (auto st = ValidateUnits(u.body(), absl::StrCat(f, ".body")); !st.ok()) return st;
    }
    for (const auto& [name, v] : {std::pair<const char*, int64_t>{"in", u.in()},
                                  {"out", u.out()},
                                  {"kernel", u.kernel()},
                                  {"stride", u.stride()},
                                  {"padding", u.padding()},
                                  {"vocab", u.vocab()},
                                  {"dim", u.dim()},
                                  {"context", u.context()},
                                  {"heads", u.heads()},
                                  {"hidden", u.hidden()},
                                  {"size", u.size()}}) {
      if (v < 0 || v > (int64_t{1} << 24)) {
        return Bad(absl::StrCat(f, ".", name), absl::StrCat(v, " is not in 0..16777216"));
      }
    }
    if (u.has_p() && !(u.p() >= 0 && u.p() < 1)) {
      return Bad(absl::StrCat(f, ".p"), "must be in [0, 1)");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateModelSpec(const v1::ModelSpec& m) {
  auto parsed = ParseModelKind(m.type());
  if (!parsed.ok()) return parsed.status();
  const ModelKind kind = *parsed;
  if (kind != ModelKind::kMlp && m.layers_size() > 0) {
    return Bad("model.layers", absl::StrCat("applies to model.type mlp only; ", m.type(),
                                            kind == ModelKind::kSequential ? " lists model.units"
                                                                           : " takes no widths"));
  }
  if (kind != ModelKind::kSequential && m.units_size() > 0) {
    return Bad("model.units", "applies to model.type sequential only");
  }
  // The zoo's settings, each for the families that read it: one set for
  // another family would be silently ignored.
  const bool mlp = kind == ModelKind::kMlp, resnet = kind == ModelKind::kResNet,
             lm = kind == ModelKind::kTransformerLm;
  for (const auto& [field, set, applies, families] :
       std::vector<std::tuple<const char*, bool, bool, const char*>>{
           {"model.activation", !m.activation().empty() && m.activation() != "relu", mlp, "mlp"},
           {"model.init", !m.init().empty() && m.init() != "torch", mlp, "mlp"},
           {"model.depth", m.depth() != 0, resnet || lm, "resnet and transformer_lm"},
           {"model.width", m.width() != 0, resnet || lm, "resnet and transformer_lm"},
           {"model.heads", m.heads() != 0, lm, "transformer_lm"},
           {"model.context", m.context() != 0, lm, "transformer_lm"},
           {"model.dropout", m.dropout() != 0, lm, "transformer_lm"}}) {
    if (set && !applies) {
      return Bad(field, absl::StrCat("applies to model.type ", families, " only, not ", m.type(),
                                     "; remove it"));
    }
  }
  if (ModelUnitCount(m) > kMaxModelUnits) {
    return Bad(kind == ModelKind::kMlp          ? "model.layers"
               : kind == ModelKind::kSequential ? "model.units"
                                                : "model.depth",
               absl::StrCat("makes ", ModelUnitCount(m), " pipeline units; at most ",
                            kMaxModelUnits, " are allowed (a unit per layer: fewer, wider ones)"));
  }
  if (kind == ModelKind::kMlp) {
    if (m.layers_size() < 2) {
      return Bad("model.layers",
                 "needs at least two widths (input and output), e.g. [784, 256, 10]");
    }
    for (int i = 0; i < m.layers_size(); ++i) {
      if (m.layers(i) < 1 || m.layers(i) > (1 << 20)) {
        return Bad(absl::StrCat("model.layers[", i, "]"),
                   absl::StrCat(m.layers(i), " is not a width in 1..1048576"));
      }
    }
    if (auto st = OneOf("model.activation", m.activation(), {"relu", "tanh", "gelu", "sigmoid"});
        !st.ok()) {
      return st;
    }
    if (auto st = OneOf("model.init", m.init(), {"torch", "he"}); !st.ok()) return st;
  }
  if (kind == ModelKind::kSequential) {
    if (m.units_size() == 0) {
      return Bad("model.units",
                 "required for model.type sequential: the layers, e.g. "
                 "[{type: flatten}, {type: linear, out: 10}]");
    }
    if (auto st = ValidateUnits(m.units(), "model.units"); !st.ok()) return st;
  }
  if (kind == ModelKind::kTorchScript && m.path().empty()) {
    return Bad("model.path",
               "required for model.type torchscript: the TorchScript file of an "
               "nn.Sequential");
  }
  if (kind != ModelKind::kTorchScript && !m.path().empty()) {
    return Bad("model.path", "applies to model.type torchscript only");
  }
  if (kind == ModelKind::kResNet || kind == ModelKind::kTransformerLm) {
    v1::ModelSpec resolved = m;
    // The data's class count and context are checked when the data is read.
    if (auto st = ResolveModel(resolved, resolved.classes() ? resolved.classes() : 1,
                               resolved.context() ? resolved.context() : 1);
        !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ResolveModel(v1::ModelSpec& m, int64_t classes, int64_t context) {
  if (ModelKindOf(m.type()) == ModelKind::kResNet) {
    if (m.depth() == 0) m.set_depth(20);
    if (m.width() == 0) m.set_width(16);
    if (m.depth() < 8 || (m.depth() - 2) % 6 != 0 || m.depth() > 1000) {
      return Bad("model.depth", absl::StrCat(m.depth(),
                                             " is not 6n + 2 with n in 1..166; use 20, "
                                             "32, 56, ..."));
    }
    if (m.width() < 1 || m.width() > 4096) return Bad("model.width", "must be in 1..4096");
  } else if (ModelKindOf(m.type()) == ModelKind::kTransformerLm) {
    if (m.depth() == 0) m.set_depth(2);
    if (m.width() == 0) m.set_width(128);
    if (m.heads() == 0) m.set_heads(4);
    if (m.context() == 0) m.set_context(static_cast<int32_t>(context));
    if (m.depth() < 1 || m.depth() > 1024) return Bad("model.depth", "must be in 1..1024");
    if (m.width() < 1 || m.width() > 65536) return Bad("model.width", "must be in 1..65536");
    if (m.heads() < 1 || m.width() % m.heads() != 0) {
      return Bad("model.heads", absl::StrCat(m.heads(), " heads do not divide model.width ",
                                             m.width(), "; use a divisor such as 4"));
    }
    if (!(m.dropout() >= 0 && m.dropout() < 1)) return Bad("model.dropout", "must be in [0, 1)");
    if (m.context() < context) {
      return Bad("model.context", absl::StrCat(m.context(), " positions but data.context is ",
                                               context, "; use at least ", context));
    }
  } else {
    return absl::OkStatus();
  }
  if (m.classes() != 0 && m.classes() != classes) {
    return Bad("model.classes", absl::StrCat("is ", m.classes(), " but the data has ", classes,
                                             "; leave it out (it is read from the data)"));
  }
  m.set_classes(classes);
  return absl::OkStatus();
}

absl::Status ValidateOptimizerSpec(const v1::OptimizerSpec& o) {
  if (auto st = ParseOptimizer(o.type()); !st.ok()) return st.status();
  if (!(o.lr() > 0)) return Bad("optimizer.lr", "required, a number > 0 (e.g. 0.05)");
  if (o.momentum() < 0 || o.momentum() >= 1) return Bad("optimizer.momentum", "must be in [0, 1)");
  if (o.weight_decay() < 0) return Bad("optimizer.weight_decay", "must be >= 0");
  const bool sgd = OptimizerOf(o.type()) == OptimizerKind::kSgd;
  if (!sgd && o.momentum() != 0) {
    return Bad("optimizer.momentum",
               absl::StrCat("applies to sgd only; ", o.type(), "'s is optimizer.beta1"));
  }
  if (!sgd && o.nesterov()) return Bad("optimizer.nesterov", "applies to sgd only");
  for (const auto& [field, set, value] :
       {std::tuple<const char*, bool, double>{"optimizer.beta1", o.has_beta1(), o.beta1()},
        {"optimizer.beta2", o.has_beta2(), o.beta2()}}) {
    if (set && sgd) return Bad(field, "applies to adam and adamw only");
    if (set && !(value >= 0 && value < 1)) return Bad(field, "must be in [0, 1)");
  }
  if (o.has_eps() && sgd) return Bad("optimizer.eps", "applies to adam and adamw only");
  if (o.has_eps() && !(o.eps() > 0)) return Bad("optimizer.eps", "must be > 0 (e.g. 1e-8)");
  if (!(o.grad_clip_norm() >= 0)) {
    return Bad("optimizer.grad_clip_norm", "must be >= 0 (0 = no clipping)");
  }
  if (auto st = ParseLrSchedule(o.lr_schedule()); !st.ok()) return st.status();
  if (LrScheduleOf(o.lr_schedule()) == LrScheduleKind::kStep && o.lr_step_size() < 1) {
    return Bad("optimizer.lr_step_size",
               "required for lr_schedule step: steps between decays, >= 1");
  }
  if (o.lr_step_size() < 0) return Bad("optimizer.lr_step_size", "must be >= 1");
  if (o.has_lr_step_gamma() && !(o.lr_step_gamma() > 0 && o.lr_step_gamma() <= 1)) {
    return Bad("optimizer.lr_step_gamma", "must be in (0, 1]");
  }
  if (o.lr_warmup_steps() < 0) return Bad("optimizer.lr_warmup_steps", "must be >= 0 (0 = off)");
  if (o.nesterov() && o.momentum() <= 0) {
    return Bad("optimizer.nesterov", "needs optimizer.momentum > 0");
  }
  return absl::OkStatus();
}

absl::Status RequireFiniteFields(const pb::Message& msg, const std::string& path) {
  const pb::Reflection* r = msg.GetReflection();
  std::vector<const FD*> fields;
  r->ListFields(msg, &fields);  // the fields set (repeated: non-empty)
  for (const FD* f : fields) {
    const std::string name = path.empty() ? f->name() : absl::StrCat(path, ".", f->name());
    const int n = f->is_repeated() ? r->FieldSize(msg, f) : 1;
    for (int i = 0; i < n; ++i) {
      const std::string at = f->is_repeated() ? absl::StrCat(name, "[", i, "]") : name;
      double v = 0;
      switch (f->cpp_type()) {
        case FD::CPPTYPE_DOUBLE:
          v = f->is_repeated() ? r->GetRepeatedDouble(msg, f, i) : r->GetDouble(msg, f);
          break;
        case FD::CPPTYPE_FLOAT:
          v = f->is_repeated() ? r->GetRepeatedFloat(msg, f, i) : r->GetFloat(msg, f);
          break;
        case FD::CPPTYPE_MESSAGE: {
          const pb::Message& sub =
              f->is_repeated() ? r->GetRepeatedMessage(msg, f, i) : r->GetMessage(msg, f);
          if (auto st = RequireFiniteFields(sub, at); !st.ok()) return st;
          continue;
        }
        default:
          continue;
      }
      if (!std::isfinite(v)) {
        return Bad(at, absl::StrCat(std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf"),
                                    " is not a number it can use; give a finite value"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  if (auto st = RequireFiniteFields(spec); !st.ok()) return st;
  static const std::regex kName("[A-Za-z0-9._-]{1,64}");
  if (spec.name().empty()) return Bad("name", "required (1..64 chars of A-Z a-z 0-9 . _ -)");
  if (!std::regex_match(spec.name(), kName)) {
    return Bad("name",
               absl::StrCat("'", spec.name(), "' must be 1..64 chars of A-Z a-z 0-9 . _ -"));
  }
  // model
  const auto& m = spec.model();
  if (auto st = ValidateModelSpec(m); !st.ok()) return st;
  // data
  const auto& d = spec.data();
  auto parsed_data = ParseDataKind(d.type());
  if (!parsed_data.ok()) return parsed_data.status();
  const DataKind data_kind = *parsed_data;
  const bool idx = IsIdx(data_kind);
  const bool cifar = data_kind == DataKind::kCifar, text = data_kind == DataKind::kText;
  // Where this type's files are named, for "applies to ... only" errors.
  const std::string files_are =
      idx     ? "idx files are data.train_images, data.train_labels, data.test_images and "
                "data.test_labels"
      : cifar ? "cifar's files are data.train_files and data.test_files"
              : "text reads the corpus file at data.path";
  const std::pair<const char*, const std::string*> files[] = {
      {"data.train_images", &d.train_images()},
      {"data.train_labels", &d.train_labels()},
      {"data.test_images", &d.test_images()},
      {"data.test_labels", &d.test_labels()}};
  bool any_file = false;
  for (const auto& [field, value] : files) any_file |= !value->empty();
  for (const auto& [field, value] : files) {
    if (!idx && !value->empty()) {
      return Bad(field, absl::StrCat("applies to data.type idx and mnist only; ", files_are));
    }
  }
  for (const auto& [field, size] :
       {std::pair<const char*, int>{"data.train_files", d.train_files_size()},
        {"data.test_files", d.test_files_size()}}) {
    if (!cifar && size > 0) {
      return Bad(field, absl::StrCat("applies to data.type cifar only; ", files_are));
    }
  }
  if (!text && d.validation_fraction() != 0) {
    return Bad("data.validation_fraction", "applies to data.type text only");
  }
  if (!text && d.context() != 0) return Bad("data.context", "applies to data.type text only");
  if (text && d.has_normalize()) {
    return Bad("data.normalize", "applies to images only (data.type idx, mnist, cifar)");
  }
  if (data_kind == DataKind::kMnist && d.has_normalize() && !d.normalize()) {
    return Bad("data.normalize",
               "mnist always normalises with MNIST's mean 0.1307 and std 0.3081; for pixels / 255 "
               "use data.type idx with normalize: false");
  }
  if (idx) {
    for (const auto& [field, value] : files) {
      if (any_file && value->empty()) {
        return Bad(field,
                   "required with the other file fields: give all of data.train_images, "
                   "data.train_labels, data.test_images and data.test_labels, or none");
      }
    }
    if (!any_file && d.path().empty()) {
      return Bad("data.path",
                 "required: the directory with the four idx files (train-images-idx3-ubyte, ...), "
                 "unless data.train_images, data.train_labels, data.test_images and "
                 "data.test_labels are given");
    }
  }
  if (cifar) {
    for (const auto& [field, list] :
         {std::pair<const char*, const pb::RepeatedPtrField<std::string>*>{"data.train_files",
                                                                           &d.train_files()},
          {"data.test_files", &d.test_files()}}) {
      for (int i = 0; i < list->size(); ++i) {
        if ((*list)[i].empty()) {
          return Bad(absl::StrCat(field, "[", i, "]"),
                     "empty; give the path of a CIFAR-10 batch file");
        }
      }
    }
    if (d.path().empty() && (d.train_files().empty() || d.test_files().empty())) {
      return Bad("data.path",
                 "required for data.type cifar: the directory holding data_batch_1.bin .. "
                 "data_batch_5.bin and test_batch.bin (CIFAR-10's binary version), unless both "
                 "data.train_files and data.test_files are given");
    }
  }
  if (text) {
    if (d.path().empty()) {
      return Bad("data.path", "required for data.type text: the corpus, a plain-text file");
    }
    if (d.context() < 0 || d.context() > 65536) {
      return Bad("data.context",
                 absl::StrCat(d.context(), " is not in 1..65536 (tokens per example; default 64)"));
    }
    if (d.validation_fraction() != 0 &&
        !(d.validation_fraction() > 0 && d.validation_fraction() < 1)) {
      return Bad("data.validation_fraction",
                 absl::StrCat(d.validation_fraction(),
                              " is not in (0, 1) (the held-out end of the corpus; default 0.1)"));
    }
  }
  if (d.train_limit() < 0) return Bad("data.train_limit", "must be >= 0 (0 = all)");
  if (d.test_limit() < 0) return Bad("data.test_limit", "must be >= 0 (0 = all)");
  // MNIST's sizes are known without reading it; other data and models are
  // checked against each other when the data is read.
  if (data_kind == DataKind::kMnist && ModelKindOf(m.type()) == ModelKind::kMlp) {
    if (m.layers(0) != 784) {
      return Bad("model.layers[0]",
                 absl::StrCat("is ", m.layers(0), " but MNIST images have 784 pixels; use 784"));
    }
    if (m.layers(m.layers_size() - 1) != 10) {
      return Bad(
          absl::StrCat("model.layers[", m.layers_size() - 1, "]"),
          absl::StrCat("is ", m.layers(m.layers_size() - 1), " but MNIST has 10 classes; use 10"));
    }
  }
  if (auto st = ValidateOptimizerSpec(spec.optimizer()); !st.ok()) return st;
  // schedule
  const auto& s = spec.schedule();
  if (auto kind = ParseScheduleKind(s.type()); !kind.ok()) return kind.status();
  const int units = ModelUnitCount(m);
  if (s.stages() < 1) return Bad("schedule.stages", "required, an integer >= 1");
  if (units > 0 && s.stages() > units) {  // 0: the count is known only later
    return Bad("schedule.stages", absl::StrCat(s.stages(), " stages but the model has only ", units,
                                               " units; use at most ", units, " or add layers"));
  }
  if (s.microbatch_size() < 1 || s.microbatch_size() > 65536) {
    return Bad("schedule.microbatch_size", "must be in 1..65536");
  }
  if (s.microbatches_per_step() < 1 || s.microbatches_per_step() > 4096) {
    return Bad("schedule.microbatches_per_step", "must be in 1..4096");
  }
  if (s.has_replicas() && (s.replicas() < 1 || s.replicas() > kMaxReplicas)) {
    return Bad("schedule.replicas",
               absl::StrCat(s.replicas(), ": copies of the pipeline must be in 1..", kMaxReplicas,
                            " (unset: 1); each needs schedule.stages more workers"));
  }
  if (s.lr_anneal_steps() < 0) return Bad("schedule.lr_anneal_steps", "must be >= 0 (0 = T1 off)");
  if (s.lr_anneal_epochs() < 0) return Bad("schedule.lr_anneal_epochs", "must be >= 0");
  if (s.lr_anneal_steps() > 0 && s.lr_anneal_epochs() > 0) {
    return Bad("schedule.lr_anneal_epochs",
               "give either lr_anneal_steps or lr_anneal_epochs, not both");
  }
  if (s.warmup_steps() < 0) return Bad("schedule.warmup_steps", "must be >= 0 (0 = no warm-up)");
  if (s.warmup_epochs() < 0) return Bad("schedule.warmup_epochs", "must be >= 0");
  if (s.warmup_steps() > 0 && s.warmup_epochs() > 0) {
    return Bad("schedule.warmup_epochs", "give either warmup_steps or warmup_epochs, not both");
  }
  const ScheduleKind kind = ScheduleKindOf(s);
  if (s.has_recompute() && !s.recompute() && !BackwardUsesForwardWeights(kind)) {
    return Bad("schedule.recompute",
               absl::StrCat("false needs a backward at the forward's weights; ", s.type(),
                            " differentiates at other weights (w_t, T2's u_bkwd) and must "
                            "recompute: remove it or set it true"));
  }
  if (kind == ScheduleKind::kPipeDream2BW) {
    if (s.microbatches_per_step() < s.stages() - 1) {
      return Bad("schedule.microbatches_per_step",
                 absl::StrCat(s.microbatches_per_step(), " with ", s.stages(),
                              " stages: pipedream_2bw keeps two weight versions, enough only when "
                              "a step has at least stages - 1 microbatches; use at least ",
                              s.stages() - 1));
    }
    for (const auto& [set, field] :
         {std::pair<bool, const char*>{s.weight_prediction(), "schedule.weight_prediction"},
          {s.delay_compensation() > 0, "schedule.delay_compensation"},
          {s.spike_compensation(), "schedule.spike_compensation"}}) {
      if (set) {
        return Bad(field,
                   "is for pipemare, pipedream and async; pipedream_2bw's delay is its own "
                   "design (two weight versions): remove it");
      }
    }
  }
  if (s.has_discrepancy_decay() && s.discrepancy_decay() >= 1) {
    return Bad("schedule.discrepancy_decay", "must be in [0, 1) (negative = T2 off)");
  }
  if (s.weight_prediction()) {
    const v1::OptimizerSpec& o = spec.optimizer();
    const bool sgd = OptimizerOf(o.type()) == OptimizerKind::kSgd;
    if (sgd && o.momentum() <= 0) {
      return Bad("schedule.weight_prediction",
                 "predicts from the optimizer's direction: sgd needs optimizer.momentum > 0 "
                 "(or use adam/adamw)");
    }
    if (ScheduleKindOf(s) == ScheduleKind::kPipeMare && s.has_discrepancy_decay() &&
        s.discrepancy_decay() >= 0) {
      return Bad("schedule.weight_prediction",
                 "and T2 (schedule.discrepancy_decay) pull in opposite directions: prediction "
                 "moves the forward's weights to the backward's, T2 the backward's back to the "
                 "forward's; unset discrepancy_decay or set this false");
    }
  }
  if (!std::isfinite(s.delay_compensation()) || s.delay_compensation() < 0 ||
      s.delay_compensation() > 100) {
    return Bad("schedule.delay_compensation",
               "is DC-ASGD's λ0: a number in [0, 100] (0 = off; Zheng et al. use 0.04 to 2)");
  }
  if (s.delay_compensation() > 0 && s.weight_prediction()) {
    return Bad("schedule.delay_compensation",
               "corrects a gradient for the weights having moved since its forward, which "
               "weight_prediction already anticipates: set one of them");
  }
  if (s.spike_compensation()) {
    const v1::OptimizerSpec& o = spec.optimizer();
    if (OptimizerOf(o.type()) != OptimizerKind::kSgd) {
      return Bad("schedule.spike_compensation",
                 absl::StrCat("applies to optimizer.type sgd (momentum's velocity); '", o.type(),
                              "' has none: set it false"));
    }
    if (o.nesterov()) {
      return Bad("schedule.spike_compensation",
                 "is defined for plain momentum: set optimizer.nesterov false or this false");
    }
  }
  if (auto dtype = ParseWireDtype(s.wire_dtype()); !dtype.ok()) return dtype.status();
  auto transport = ParseTransport(s.transport());
  if (!transport.ok()) return transport.status();
  if (s.has_data_plane_min_bytes()) {
    if (*transport != Transport::kGloo) {
      return Bad("schedule.data_plane_min_bytes",
                 "applies to transport gloo (on grpc every tensor rides the Pipe stream): remove "
                 "it or set schedule.transport: gloo");
    }
    if (s.data_plane_min_bytes() < 0) {
      return Bad("schedule.data_plane_min_bytes",
                 absl::StrCat(s.data_plane_min_bytes(),
                              " is negative: give bytes >= 0 (0 sends every tensor over Gloo)"));
    }
  }
  auto partition = ParsePartition(s.partition());
  if (!partition.ok()) return partition.status();
  if (*partition != PartitionKind::kSplit && s.split_size() > 0) {
    return Bad("schedule.split",
               "applies to partition split only; set schedule.partition: split "
               "or remove schedule.split");
  }
  if (*partition == PartitionKind::kSplit) {
    const std::vector<int> split(s.split().begin(), s.split().end());
    if (units > 0) {  // the coordinator checks again once the unit count is known
      if (auto st = PartitionFromSplit(split, units, s.stages()).status(); !st.ok()) return st;
    } else {
      if (s.split_size() != s.stages() - 1) {
        return Bad("schedule.split", absl::StrCat(s.split_size(), " points for ", s.stages(),
                                                  " stages; give stages - 1 = ", s.stages() - 1));
      }
      for (int i = 0; i < s.split_size(); ++i) {
        const std::string f = absl::StrCat("schedule.split[", i, "]");
        if (s.split(i) < 1) {
          return Bad(f, absl::StrCat(s.split(i),
                                     " is out of range; split points are the first "
                                     "units of stages 1..P-1, >= 1"));
        }
        if (i > 0 && s.split(i) <= s.split(i - 1)) {
          return Bad(f, absl::StrCat(s.split(i), " is not after schedule.split[", i - 1,
                                     "] = ", s.split(i - 1), "; split points must increase"));
        }
      }
    }
  }
  // T1 and T2 fields are accepted and ignored by every schedule but
  // pipemare, so a user can flip schedule.type on the same file and compare.
  // train
  const auto& t = spec.train();
  if (t.epochs() < 1 || t.epochs() > 100000)
    return Bad("train.epochs", "required, an integer in 1..100000");
  if (auto policy = ParseOnNonFinite(t.on_nonfinite()); !policy.ok()) return policy.status();
  // checkpoint
  const auto& c = spec.checkpoint();
  if (c.every_steps() < 0) {
    return Bad("checkpoint.every_steps", "must be >= 0 (0: only after the last step)");
  }
  if (c.keep() < 0 || c.keep() > 1000) {
    return Bad("checkpoint.keep", "must be in 1..1000 (newest checkpoints kept; default 3)");
  }
  if (c.dir().size() > 4096 || c.dir().find('\0') != std::string::npos) {
    return Bad("checkpoint.dir", "must be a path of at most 4096 bytes");
  }
  // recovery
  const auto& r = spec.recovery();
  if (r.max_restarts() < 0 || r.max_restarts() > 100) {
    return Bad("recovery.max_restarts", "must be in 0..100 (0: a lost worker fails the job)");
  }
  if (!std::isfinite(r.wait_seconds()) || r.wait_seconds() <= 0 || r.wait_seconds() > 86400) {
    return Bad("recovery.wait_seconds",
               "must be a number of seconds in (0, 86400] (how long to wait for a replacement)");
  }
  return absl::OkStatus();
}

namespace {
// A length given in steps, or else in epochs of `steps_per_epoch`.
int64_t InSteps(int64_t steps, double epochs, int64_t steps_per_epoch) {
  return steps > 0 ? steps : static_cast<int64_t>(std::llround(epochs * steps_per_epoch));
}
}  // namespace

int64_t StepsPerEpoch(int64_t train_examples, const v1::ScheduleSpec& schedule) {
  if (schedule.microbatch_size() < 1 || schedule.microbatches_per_step() < 1) return 0;
  // Each step takes N microbatches for each of the replicas.
  return (train_examples / schedule.microbatch_size()) /
         (static_cast<int64_t>(schedule.microbatches_per_step()) * std::max(1, Replicas(schedule)));
}

int64_t WarmupSteps(const v1::ScheduleSpec& schedule, int64_t steps_per_epoch) {
  if (!IsAsynchronous(ScheduleKindOf(schedule))) return 0;
  return InSteps(schedule.warmup_steps(), schedule.warmup_epochs(), steps_per_epoch);
}

absl::StatusOr<std::vector<v1::StageAssignment>> ResolveStageAssignments(
    const v1::JobSpec& spec, const std::string& job_id, int64_t steps_per_epoch,
    const std::vector<StageRange>* given) {
  if (steps_per_epoch < 1) {
    return absl::InvalidArgumentError("steps_per_epoch: must be >= 1");
  }
  const auto& sched = spec.schedule();
  absl::StatusOr<std::vector<StageRange>> ranges =
      given != nullptr ? *given : PartitionUniform(ModelUnitCount(spec.model()), sched.stages());
  if (!ranges.ok()) return ranges.status();
  if (static_cast<int>(ranges->size()) != sched.stages()) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition: ", ranges->size(), " ranges for ", sched.stages(), " stages"));
  }
  const int64_t anneal_steps =
      InSteps(sched.lr_anneal_steps(), sched.lr_anneal_epochs(), steps_per_epoch);
  const int64_t warmup_steps = WarmupSteps(sched, steps_per_epoch);
  std::vector<v1::StageAssignment> out;
  for (int i = 0; i < sched.stages(); ++i) {
    v1::StageAssignment a;
    a.set_job_id(job_id);
    a.set_stage(i);
    a.set_num_stages(sched.stages());
    a.set_first_unit((*ranges)[i].first_unit);
    a.set_units((*ranges)[i].units);
    *a.mutable_model() = spec.model();
    *a.mutable_optimizer() = spec.optimizer();
    *a.mutable_schedule() = sched;
    a.set_seed(spec.train().seed());
    a.set_lr_anneal_steps(anneal_steps);
    a.set_warmup_steps(warmup_steps);
    a.set_steps_per_epoch(steps_per_epoch);
    a.set_total_steps(steps_per_epoch * spec.train().epochs());
    a.set_checkpoint_every_steps(spec.checkpoint().every_steps());
    a.set_checkpoint_dir(spec.checkpoint().dir());
    a.set_on_nonfinite(spec.train().on_nonfinite());
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace pipemare
