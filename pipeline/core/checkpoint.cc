#include "pipeline/core/checkpoint.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pipemare {
namespace fs = std::filesystem;

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr);
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256::Update(const void* data, size_t size) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, size);
}

std::string Sha256::Hex() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), digest, &length);
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) absl::StrAppendFormat(&hex, "%02x", digest[i]);
  return hex;
}

std::string Sha256Hex(const std::string& bytes) {
  Sha256 hash;
  hash.Update(bytes.data(), bytes.size());
  return hash.Hex();
}

namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::UnavailableError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status FsyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) return Errno("cannot open", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : Errno("cannot fsync", path);
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes) {
  const fs::path target(path);
  std::error_code ec;
  // A bare file name lives in the current directory, which exists.
  if (!target.parent_path().empty()) fs::create_directories(target.parent_path(), ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", target.parent_path().string(), ": ", ec.message()));
  }
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status st = Errno("cannot write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return st;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    absl::Status st = Errno("cannot fsync", tmp);
    ::close(fd);
    ::unlink(tmp.c_str());
    return st;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status st = Errno("cannot rename to", path);
    ::unlink(tmp.c_str());
    return st;
  }
  return FsyncPath(target.parent_path().empty() ? "." : target.parent_path().string(),
                   O_RDONLY | O_DIRECTORY);
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return out.str();
}

std::string BaseName(const std::string& path) { return fs::path(path).filename().string(); }

std::string CheckpointStepDir(const std::string& dir, const std::string& job, int64_t step) {
  return absl::StrCat(dir, "/", job, "/step-", step);
}

namespace {

using Json = nlohmann::json;

// Checks one file of a checkpoint against its size and SHA-256.
absl::Status VerifyFile(const std::string& step_dir, const WrittenFile& f) {
  const std::string path = absl::StrCat(step_dir, "/", BaseName(f.path));
  auto bytes = ReadWholeFile(path);
  if (!bytes.ok()) return absl::DataLossError(std::string(bytes.status().message()));
  if (static_cast<int64_t>(bytes->size()) != f.bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", bytes->size(), " bytes, the stage wrote ",
                                            f.bytes, " (truncated or overwritten)"));
  }
  if (Sha256Hex(*bytes) != f.sha256) {
    return absl::DataLossError(absl::StrCat(path, ": SHA-256 does not match what the stage wrote"));
  }
  return absl::OkStatus();
}

// Every unit 0..U-1 exactly once, U from the partition.
absl::Status CheckUnits(const Manifest& m) {
  int total = 0;
  for (const auto& s : m.stages) total += s.units;
  std::set<int> seen;
  for (const auto& f : m.files) {
    if (f.unit < 0 || f.unit >= total || !seen.insert(f.unit).second) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint at step ", m.step, ": unit ", f.unit, " is out of range or written twice"));
    }
  }
  if (static_cast<int>(seen.size()) != total) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint at step ", m.step, ": ", seen.size(), " of ", total, " units written"));
  }
  return absl::OkStatus();
}

// step-<k> directories of a job, newest first.
std::vector<std::pair<int64_t, std::string>> StepDirs(const std::string& job_dir) {
  std::vector<std::pair<int64_t, std::string>> dirs;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(job_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step-", 0) != 0) continue;
    char* end = nullptr;
    const long long k = std::strtoll(name.c_str() + 5, &end, 10);
    if (end != nullptr && *end == '\0' && k > 0) dirs.emplace_back(k, entry.path().string());
  }
  std::sort(dirs.rbegin(), dirs.rend());
  return dirs;
}

}  // namespace

absl::Status CommitManifest(const std::string& dir, const Manifest& m, int keep) {
  if (auto st = CheckUnits(m); !st.ok()) return st;
  const std::string step_dir = CheckpointStepDir(dir, m.job, m.step);
  const std::string job_dir = absl::StrCat(dir, "/", m.job);
  if (auto latest = ReadWholeFile(job_dir + "/latest"); latest.ok()) {
    auto current = ReadWholeFile(
        absl::StrCat(job_dir, "/", absl::StripAsciiWhitespace(*latest), "/manifest.json"));
    if (current.ok()) {
      const Json j = Json::parse(*current, nullptr, false);
      const int64_t newer =
          j.is_object() && j.contains("generation") && j["generation"].is_number_integer()
              ? j["generation"].get<int64_t>()
              : 0;
      if (newer > m.generation) {
        return absl::FailedPreconditionError(absl::StrCat(
            "fenced: ", job_dir, "/latest is a cut of generation ", newer, ", newer than this ",
            "run's ", m.generation, " (a newer run of the job took over); not committed"));
      }
    }
  }
  Json files = Json::array();
  for (const auto& f : m.files) {
    if (auto st = VerifyFile(step_dir, f); !st.ok()) return st;
    files.push_back(
        {{"unit", f.unit}, {"file", BaseName(f.path)}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  }
  Json stages = Json::array();
  for (const auto& s : m.stages)
    stages.push_back({{"first_unit", s.first_unit}, {"units", s.units}});
  Json manifest = {
      {"format", "pipemare-checkpoint-1"},
      {"job", m.job},
      {"generation", m.generation},
      {"step", m.step},
      {"microbatch", m.microbatch},
      {"epoch", m.epoch},
      {"index_in_epoch", m.index_in_epoch},
      {"seed", m.seed},
      {"stages", stages},
      {"files", files},
      {"spec", Json::parse(m.spec_json.empty() ? "{}" : m.spec_json, nullptr, false)},
      {"input", Json::parse(m.input_json.empty() ? "{}" : m.input_json, nullptr, false)}};
  if (auto st = WriteFileAtomically(step_dir + "/manifest.json", manifest.dump(2) + "\n");
      !st.ok()) {
    return st;
  }
  if (auto st = WriteFileAtomically(job_dir + "/latest", absl::StrCat("step-", m.step, "\n"));
      !st.ok()) {
    return st;
  }
  // Keep the newest `keep` committed cuts; a directory newer than this one
  // is a cut being written, kept.
  int kept = 0;
  for (const auto& [k, path] : StepDirs(job_dir)) {
    if (k > m.step) continue;
    if (kept < keep && fs::exists(path + "/manifest.json")) {
      ++kept;
      continue;
    }
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  return absl::OkStatus();
}

// An integer field of a manifest, in T's range: nlohmann's get<T>() casts a
// float or an out-of-range number unchecked (undefined behaviour).
template <typename T>
T IntegerAt(const Json& object, const char* key) {
  const Json& v = object.at(key);
  if (!v.is_number_integer()) {
    throw std::invalid_argument(absl::StrCat("'", key, "' is not an integer"));
  }
  const bool fits = v.is_number_unsigned()
                        ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                        : v.get<int64_t>() >= std::numeric_limits<T>::min() &&
                              v.get<int64_t>() <= std::numeric_limits<T>::max();
  if (!fits) throw std::out_of_range(absl::StrCat("'", key, "' is out of range"));
  return static_cast<T>(v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>())
                                               : v.get<int64_t>());
}

absl::StatusOr<Manifest> ReadManifest(const std::string& step_dir) {
  auto text = ReadWholeFile(step_dir + "/manifest.json");
  if (!text.ok()) {
    return absl::NotFoundError(absl::StrCat(step_dir, ": no manifest (a cut never committed)"));
  }
  Manifest m;
  try {
    const Json j = Json::parse(*text);
    m.job = j.at("job").get<std::string>();
    m.step = IntegerAt<int64_t>(j, "step");
    m.generation = j.contains("generation") ? IntegerAt<int64_t>(j, "generation") : 0;
    m.microbatch = IntegerAt<int64_t>(j, "microbatch");
    m.epoch = IntegerAt<int64_t>(j, "epoch");
    m.index_in_epoch = IntegerAt<int64_t>(j, "index_in_epoch");
    m.seed = IntegerAt<int64_t>(j, "seed");
    for (const auto& s : j.at("stages")) {
      m.stages.push_back({IntegerAt<int>(s, "first_unit"), IntegerAt<int>(s, "units")});
    }
    for (const auto& f : j.at("files")) {
      WrittenFile w;
      w.unit = IntegerAt<int>(f, "unit");
      const std::string file = f.at("file").get<std::string>();
      // A unit file lies in the step directory: a name, never a path that
      // leads elsewhere (a manifest is outside input).
      if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
          file.find('\0') != std::string::npos) {
        return absl::DataLossError(absl::StrCat(step_dir, "/manifest.json: unit file '", file,
                                                "' is not a plain file name"));
      }
      w.path = absl::StrCat(step_dir, "/", file);
      w.bytes = IntegerAt<int64_t>(f, "bytes");
      w.sha256 = f.at("sha256").get<std::string>();
      m.files.push_back(std::move(w));
    }
    m.spec_json = j.at("spec").dump();
    m.input_json = j.value("input", Json::object()).dump();
  } catch (const std::exception& e) {
    return absl::DataLossError(
        absl::StrCat(step_dir, "/manifest.json: not a Pipemare manifest: ", e.what()));
  }
  if (fs::path(step_dir).filename().string() != absl::StrCat("step-", m.step)) {
    return absl::DataLossError(absl::StrCat(step_dir, "/manifest.json: names step ", m.step,
                                            " (a manifest of another cut)"));
  }
  if (auto st = CheckUnits(m); !st.ok()) return absl::DataLossError(st.message());
  for (const auto& f : m.files) {
    if (auto st = VerifyFile(step_dir, f); !st.ok()) return st;
  }
  return m;
}

std::vector<int64_t> CommittedSteps(const std::string& dir, const std::string& job) {
  std::vector<int64_t> steps;
  for (const auto& [k, path] : StepDirs(absl::StrCat(dir, "/", job))) {
    if (fs::exists(path + "/manifest.json")) steps.push_back(k);
  }
  std::reverse(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<Manifest> NewestValidManifest(const std::string& dir, const std::string& job,
                                             std::vector<std::string>* skipped) {
  const std::string job_dir = absl::StrCat(dir, "/", job);
  std::vector<std::string> candidates;
  auto latest = ReadWholeFile(job_dir + "/latest");
  if (latest.ok()) {
    std::string name = *latest;
    name.erase(std::remove_if(name.begin(), name.end(), ::isspace), name.end());
    if (!name.empty()) candidates.push_back(absl::StrCat(job_dir, "/", name));
  }
  for (const auto& [k, path] : StepDirs(job_dir)) {
    if (std::find(candidates.begin(), candidates.end(), path) == candidates.end()) {
      candidates.push_back(path);
    }
  }
  for (const auto& step_dir : candidates) {
    auto m = ReadManifest(step_dir);
    if (m.ok()) return m;
    if (skipped != nullptr && m.status().code() != absl::StatusCode::kNotFound) {
      skipped->push_back(std::string(m.status().message()));
    }
  }
  return absl::NotFoundError(absl::StrCat("no valid checkpoint of ", job, " in ", dir));
}

}  // namespace pipemare
