#include "pipeline/core/file_access.h"

#include <filesystem>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pipemare {

namespace fs = std::filesystem;

namespace {

std::string& Owner() {
  static auto* owner = new std::string("this host's");
  return *owner;
}

std::vector<std::string>& Roots() {
  static auto* roots = new std::vector<std::string>();
  return *roots;
}

// `inner` is `outer` or below it (both resolved).
bool Within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

bool UnderRoots(const fs::path& resolved, const std::string& extra_root) {
  if (Roots().empty()) return true;
  for (const std::string& root : Roots()) {
    if (Within(resolved, root)) return true;
  }
  std::error_code ec;
  return !extra_root.empty() && Within(resolved, fs::weakly_canonical(extra_root, ec));
}

std::string RootsText(const std::string& extra_root) {
  std::vector<std::string> all = Roots();
  if (!extra_root.empty()) all.push_back(extra_root);
  return absl::StrJoin(all, ", ");
}

}  // namespace

absl::Status SetDataRoots(const std::vector<std::string>& roots, const std::string& flag,
                          const std::string& owner) {
  std::vector<std::string> resolved;
  for (const std::string& root : roots) {
    std::error_code ec;
    const fs::path canonical = fs::canonical(root, ec);
    if (ec || !fs::is_directory(canonical, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " ", root, ": not an existing directory"));
    }
    resolved.push_back(canonical.string());
  }
  Roots() = std::move(resolved);
  Owner() = owner;
  return absl::OkStatus();
}

const std::vector<std::string>& DataRoots() { return Roots(); }

absl::Status CheckReadableFile(const std::string& path, const std::string& field) {
  std::error_code ec;
  const fs::path resolved = fs::canonical(path, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": cannot open '", path, "' (file not found)"));
  }
  for (const char* special : {"/proc", "/sys", "/dev"}) {
    if (Within(resolved, special)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", path, " resolves to ", resolved.string(),
                       ", a system file, not data; name a regular file of training data"));
    }
  }
  const fs::file_status status = fs::status(resolved, ec);
  if (!fs::is_regular_file(status)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path,
                                                   fs::is_directory(status)
                                                       ? " is a directory"
                                                       : " is not a regular file (a device, FIFO "
                                                         "or socket)",
                                                   "; name a regular file"));
  }
  if (!UnderRoots(resolved, "")) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", path, " resolves to ", resolved.string(), ", outside ", Owner(),
        " data roots (", RootsText(""),
        "); put the data under one of them, or ask the operator to add a --data-root"));
  }
  return absl::OkStatus();
}

absl::Status CheckDirectoryUnderRoots(const std::string& path, const std::string& field,
                                      const std::string& extra_root) {
  if (Roots().empty()) return absl::OkStatus();
  std::error_code ec;
  const fs::path resolved = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec || !UnderRoots(resolved, extra_root)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", path, " resolves to ", resolved.string(), ", outside ", Owner(),
        " data roots (", RootsText(extra_root), "); use a directory under one of them"));
  }
  return absl::OkStatus();
}

}  // namespace pipemare
