#include "pipeline/model/checkpoint_units.h"

#include <torch/script.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pipemare {

absl::StatusOr<std::vector<WrittenFile>> WriteStageSnapshot(const std::string& dir,
                                                            const std::string& job,
                                                            const StageSnapshot& snapshot) {
  std::vector<WrittenFile> files;
  const std::string step_dir = CheckpointStepDir(dir, job, snapshot.step);
  for (const UnitState& unit : snapshot.units) {
    auto bytes = UnitFileBytes(unit, snapshot.step);
    if (!bytes.ok()) return bytes.status();
    WrittenFile f;
    f.unit = unit.unit;
    f.path = snapshot.generation > 0
                 ? absl::StrFormat("%s/unit-%05d.g%d.pt", step_dir, unit.unit, snapshot.generation)
                 : absl::StrFormat("%s/unit-%05d.pt", step_dir, unit.unit);
    f.bytes = static_cast<int64_t>(bytes->size());
    f.sha256 = Sha256Hex(*bytes);
    if (auto st = WriteFileAtomically(f.path, *bytes); !st.ok()) return st;
    files.push_back(std::move(f));
  }
  return files;
}

absl::StatusOr<std::string> UnitFileBytes(const UnitState& unit, int64_t step) {
  try {
    c10::Dict<std::string, torch::Tensor> dict;
    for (const auto& [name, tensor] : unit.tensors) dict.insert(name, tensor);
    dict.insert("meta/step", torch::tensor(step, torch::kInt64));
    dict.insert("meta/unit", torch::tensor(static_cast<int64_t>(unit.unit), torch::kInt64));
    const std::vector<char> pickled = torch::pickle_save(c10::IValue(dict));
    return std::string(pickled.begin(), pickled.end());
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("serialising unit ", unit.unit, ": ", e.what_without_backtrace()));
  }
}

absl::StatusOr<UnitState> ReadUnitFile(const std::string& path, const std::string& sha256) {
  auto bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  return ParseUnitFile(*bytes, sha256, path);
}

absl::StatusOr<UnitState> ParseUnitFile(const std::string& bytes, const std::string& sha256,
                                        const std::string& name) {
  if (!sha256.empty() && Sha256Hex(bytes) != sha256) {
    return absl::DataLossError(absl::StrCat(name, ": SHA-256 does not match the manifest (",
                                            bytes.size(), " bytes; truncated or overwritten)"));
  }
  UnitState unit;
  try {
    const std::vector<char> data(bytes.begin(), bytes.end());
    c10::IValue value = torch::pickle_load(data);
    if (!value.isGenericDict()) throw std::invalid_argument("not a dict of tensors");
    for (const auto& item : value.toGenericDict()) {
      const std::string key = item.key().toStringRef();
      const torch::Tensor t = item.value().toTensor();
      if (key == "meta/unit") {
        unit.unit = static_cast<int>(t.item<int64_t>());
      } else if (key.rfind("meta/", 0) != 0) {
        unit.tensors.emplace_back(key, t);
      }
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(name, ": not a unit checkpoint: ", e.what()));
  }
  return unit;
}

absl::StatusOr<ExportedModel> ExportModel(const std::string& step_dir, const Manifest& m,
                                          const std::string& torchscript) {
  std::map<int, UnitState> units;
  for (const auto& f : m.files) {
    auto unit = ReadUnitFile(absl::StrCat(step_dir, "/", BaseName(f.path)), f.sha256);
    if (!unit.ok()) return unit.status();
    units[f.unit] = std::move(*unit);
  }
  ExportedModel out;
  try {
    if (torchscript.empty()) {
      c10::Dict<std::string, torch::Tensor> dict;
      for (const auto& [u, unit] : units) {
        for (const auto& [key, tensor] : unit.tensors) {
          const bool param = key.rfind("param/", 0) == 0, buffer = key.rfind("buffer/", 0) == 0;
          if (!param && !buffer) continue;  // optimizer state and T2's δ stay in the checkpoint
          std::string name = key.substr(param ? 6 : 7);
          if (name.rfind("seq.", 0) == 0) name = name.substr(4);  // a unit is its layers
          dict.insert(absl::StrCat(u, ".", name), tensor);
        }
      }
      const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
      out.bytes.assign(bytes.begin(), bytes.end());
      out.format = "state_dict";
      return out;
    }
    std::istringstream in(torchscript);
    torch::jit::Module module = torch::jit::load(in, torch::Device(torch::kCPU));
    torch::NoGradGuard no_grad;
    int u = 0;
    for (const auto& child : module.children()) {
      const auto it = units.find(u);
      if (it == units.end()) {
        return absl::DataLossError(absl::StrCat("the checkpoint has no unit ", u));
      }
      std::map<std::string, torch::Tensor> saved(it->second.tensors.begin(),
                                                 it->second.tensors.end());
      auto load = [&](const std::string& kind, const std::string& name, torch::Tensor value) {
        std::string clean = name;  // as ScriptUnit registers it (pipeline/model/model.cc)
        std::replace(clean.begin(), clean.end(), '.', '_');
        auto t = saved.find(kind + clean);
        if (t == saved.end()) {
          throw std::invalid_argument(absl::StrCat("unit ", u, " has no ", kind, clean));
        }
        value.copy_(t->second);
      };
      for (const auto& p : child.named_parameters(/*recurse=*/true))
        load("param/", p.name, p.value);
      for (const auto& b : child.named_buffers(/*recurse=*/true)) load("buffer/", b.name, b.value);
      ++u;
    }
    std::ostringstream saved;
    module.save(saved);
    out.bytes = saved.str();
    out.format = "torchscript";
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat("exporting ", step_dir, ": ", e.what()));
  }
  return out;
}

}  // namespace pipemare
