#include "pipeline/core/data.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipeline/core/checkpoint.h"
#include "pipeline/core/file_access.h"
#include "pipeline/core/mnist.h"
#include "pipeline/core/settings.h"

namespace pipemare {
namespace {

namespace fs = std::filesystem;

constexpr const char* kCifarLayout =
    "data_batch_1.bin .. data_batch_5.bin and test_batch.bin (CIFAR-10's binary version, "
    "cifar-10-binary.tar.gz)";

absl::Status Invalid(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}
absl::Status Invalid(const DataFile& f, const std::string& message) {
  return Invalid(f.field, absl::StrCat(f.path, ": ", message));
}

std::string Shape(const std::vector<int64_t>& shape) { return absl::StrJoin(shape, "x"); }

// The size of a regular file (`what` it should be), or why it is not one;
// `hint` ends the error.
absl::StatusOr<int64_t> FileSize(const DataFile& f, const std::string& what,
                                 const std::string& hint) {
  std::error_code ec;
  const fs::file_status st = fs::status(f.path, ec);
  if (ec || !fs::exists(st)) return Invalid(f, absl::StrCat("file not found", hint));
  if (fs::is_directory(st)) return Invalid(f, absl::StrCat("is a directory, not ", what, hint));
  if (!fs::is_regular_file(st)) {
    return Invalid(f, absl::StrCat("is not a regular file but should be ", what, hint));
  }
  if (auto access = CheckReadableFile(f.path, f.field); !access.ok()) return access;
  const uintmax_t size = fs::file_size(f.path, ec);
  if (ec) return Invalid(f, absl::StrCat("cannot read its size (", ec.message(), ")"));
  return static_cast<int64_t>(size);
}

// The fault of a failed open(), from errno.
std::string CannotOpen() {
  return absl::StrCat("cannot be opened for reading (", std::strerror(errno), ")");
}

// A file descriptor closed on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// Reads exactly `n` bytes at `offset`; false if the file ends first or a read
// fails.
bool ReadAt(int fd, int64_t offset, void* out, int64_t n) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)), offset);
    if (got <= 0) return false;
    p += got, offset += got, n -= got;
  }
  return true;
}

// Allocation that fails with an error, not an exception, for data sets too
// large for the coordinator's memory.
template <typename T>
absl::Status Allocate(std::vector<T>& v, int64_t n, const std::string& field,
                      const std::string& what) {
  try {
    v.resize(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        field, ": ", what, " needs ", n * static_cast<int64_t>(sizeof(T)),
        " bytes of memory, more than the coordinator can allocate; use data.train_limit and "
        "data.test_limit"));
  } catch (const std::length_error&) {
    return absl::ResourceExhaustedError(absl::StrCat(field, ": ", what, " is too large"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// idx and mnist (pipeline/core/mnist.h).

std::vector<int64_t> IdxShape(int64_t rows, int64_t cols) { return {1, rows, cols}; }

DataInfo IdxDataInfo(const v1::DataSpec& d, int64_t rows, int64_t cols, int64_t classes,
                     int64_t train_count, int64_t test_count) {
  DataInfo info;
  info.task = Task::kClassification;
  info.input_shape = IdxShape(rows, cols);
  info.classes = classes;
  info.train_count = train_count;
  info.test_count = test_count;
  info.description = absl::StrCat(d.type(), ": ", train_count, " train, ", test_count, " test ",
                                  Shape(info.input_shape), " images, ", classes, " classes");
  return info;
}

Examples FromImages(ImageDataset&& ds) {
  Examples e;
  e.count = ds.count;
  e.input_shape = IdxShape(ds.rows, ds.cols);
  e.inputs = std::move(ds.pixels);
  e.targets = std::move(ds.labels);
  return e;
}

absl::StatusOr<DataInfo> InspectIdxData(const v1::DataSpec& d) {
  auto idx = InspectIdx(d);
  if (!idx.ok()) return idx.status();
  return IdxDataInfo(d, idx->rows, idx->cols, idx->classes, idx->train_count, idx->test_count);
}

absl::StatusOr<Data> LoadIdxData(const v1::DataSpec& d) {
  auto ds = LoadDataset(d);
  if (!ds.ok()) return ds.status();
  Data out;
  out.info =
      IdxDataInfo(d, ds->train.rows, ds->train.cols, ds->classes, ds->train.count, ds->test.count);
  const Normalisation n = ds->normalisation;
  out.channels = {n};
  if (DataKindOf(d.type()) == DataKind::kMnist) {
    out.normalisation = absl::StrCat("mean ", n.mean, " std ", n.std, " (MNIST's)");
  } else if (n.mean == 0 && n.std == 1) {
    out.normalisation = "none (pixel / 255)";
  } else {
    out.normalisation = absl::StrCat("mean ", n.mean, " std ", n.std, " (training pixels)");
  }
  out.train = FromImages(std::move(ds->train));
  out.test = FromImages(std::move(ds->test));
  return out;
}

// ---------------------------------------------------------------------------
// cifar.

// A CIFAR-10 batch file: its records, and their label bytes.
struct CifarFile {
  DataFile file;
  int64_t records = 0;
  std::vector<unsigned char> labels;
};

// The files of one split: data.train_files / data.test_files (relative ones
// resolved against data.path), else the standard names in data.path.
absl::StatusOr<std::vector<DataFile>> CifarFiles(const v1::DataSpec& d, bool train) {
  const auto& listed = train ? d.train_files() : d.test_files();
  const char* list_field = train ? "data.train_files" : "data.test_files";
  std::vector<DataFile> files;
  if (!listed.empty()) {
    for (int i = 0; i < listed.size(); ++i) {
      const std::string field = absl::StrCat(list_field, "[", i, "]");
      const std::string& p = listed[i];
      if (p.empty()) return Invalid(field, "empty; give the path of a CIFAR-10 batch file");
      files.push_back({ResolveDataPath(d.path(), p), field});
    }
    return files;
  }
  const std::string how = absl::StrCat("for type cifar data.path is the directory holding ",
                                       kCifarLayout, ", unless ", list_field, " is given");
  if (d.path().empty()) return Invalid("data.path", absl::StrCat("required; ", how));
  std::error_code ec;
  const fs::file_status st = fs::status(d.path(), ec);
  if (ec || !fs::exists(st)) {
    return Invalid("data.path", absl::StrCat(d.path(), ": no such directory; ", how));
  }
  if (!fs::is_directory(st)) {
    return Invalid("data.path", absl::StrCat(d.path(), ": not a directory; ", how));
  }
  if (train) {
    for (int k = 1; k <= 5; ++k) {
      const std::string p = ResolveDataPath(d.path(), absl::StrCat("data_batch_", k, ".bin"));
      if (fs::exists(p, ec)) files.push_back({p, "data.path"});
    }
    if (files.empty()) {
      std::string hint;
      const std::string nested = ResolveDataPath(d.path(), "cifar-10-batches-bin");
      if (fs::is_directory(nested, ec)) hint = absl::StrCat(" (use data.path: ", nested, ")");
      return Invalid("data.path",
                     absl::StrCat(d.path(), " holds none of data_batch_1.bin .. data_batch_5.bin",
                                  hint, "; ", how));
    }
  } else {
    files.push_back({ResolveDataPath(d.path(), "test_batch.bin"), "data.path"});
  }
  return files;
}

// Checks a batch file's size and reads its label bytes (one pread per
// record: the pixels are not copied).
absl::StatusOr<CifarFile> OpenCifar(const DataFile& f) {
  auto size = FileSize(f, "a CIFAR-10 binary batch file", "");
  if (!size.ok()) return size.status();
  const std::string record = absl::StrCat(kCifarRecordBytes, "-byte records (1 label byte and ",
                                          kCifarImageBytes, " pixel bytes: 3x32x32)");
  if (*size == 0) {
    return Invalid(f, absl::StrCat("empty file (0 bytes); a CIFAR-10 batch holds ", record));
  }
  if (*size % kCifarRecordBytes != 0) {
    const int64_t whole = *size / kCifarRecordBytes;
    auto records = [](int64_t n) { return absl::StrCat(n, n == 1 ? " record" : " records"); };
    std::string should =
        whole == 0 ? absl::StrCat(kCifarRecordBytes, " for one record")
                   : absl::StrCat(whole * kCifarRecordBytes, " for ", records(whole), " or ",
                                  (whole + 1) * kCifarRecordBytes, " for ", records(whole + 1));
    std::string fault = "truncated or not a CIFAR-10 binary batch", hint;
    if (*size % (kCifarRecordBytes + 1) == 0) {
      fault = "not a CIFAR-10 binary batch";
      hint = absl::StrCat(" (it is a whole number of ", kCifarRecordBytes + 1,
                          "-byte records: CIFAR-100's binary format, with 2 label bytes, which "
                          "type cifar does not read)");
    }
    return Invalid(f, absl::StrCat(fault, ": ", *size, " bytes is not a whole number of ", record,
                                   "; it should be a multiple of ", kCifarRecordBytes, ", e.g. ",
                                   should, hint));
  }
  CifarFile out{f, *size / kCifarRecordBytes, {}};
  Fd fd(f.path);
  if (fd.fd < 0) return Invalid(f, CannotOpen());
  if (auto st = Allocate(out.labels, out.records, f.field, f.path); !st.ok()) return st;
  for (int64_t r = 0; r < out.records; ++r) {
    if (!ReadAt(fd.fd, r * kCifarRecordBytes, &out.labels[r], 1)) {
      return Invalid(f, absl::StrCat("read error or truncated at record ", r, " of ", out.records,
                                     " (the file changed while being read?)"));
    }
  }
  return out;
}

// Both splits' files with their labels checked: the classes are max(label) +
// 1 over every training record; the test labels in use must be below that.
struct CifarSplits {
  std::vector<CifarFile> train, test;
  int64_t classes = 0;
  int64_t train_count = 0, test_count = 0;
};

absl::StatusOr<CifarSplits> OpenCifarSplits(const v1::DataSpec& d) {
  CifarSplits s;
  for (bool train : {true, false}) {
    auto files = CifarFiles(d, train);
    if (!files.ok()) return files.status();
    for (const DataFile& f : *files) {
      auto c = OpenCifar(f);
      if (!c.ok()) return c.status();
      (train ? s.train : s.test).push_back(std::move(*c));
    }
  }
  int64_t train_records = 0, test_records = 0;
  int max_label = 0;
  for (const CifarFile& c : s.train) {
    train_records += c.records;
    for (unsigned char l : c.labels) max_label = std::max<int>(max_label, l);
  }
  s.classes = max_label + 1;
  for (const CifarFile& c : s.test) test_records += c.records;
  s.train_count = Limited(train_records, d.train_limit());
  s.test_count = Limited(test_records, d.test_limit());
  int64_t seen = 0;
  for (const CifarFile& c : s.test) {
    for (int64_t r = 0; r < c.records && seen < s.test_count; ++r, ++seen) {
      if (c.labels[r] >= s.classes) {
        return Invalid(c.file, absl::StrCat("label ", int{c.labels[r]}, " at record ", r,
                                            " is not one of the ", s.classes,
                                            " classes of the training files (0..", s.classes - 1,
                                            ", max label + 1 over every training record)"));
      }
    }
  }
  return s;
}

const std::vector<int64_t> kCifarShape = {3, 32, 32};

DataInfo CifarDataInfo(const CifarSplits& s) {
  DataInfo info;
  info.task = Task::kClassification;
  info.input_shape = kCifarShape;
  info.classes = s.classes;
  info.train_count = s.train_count;
  info.test_count = s.test_count;
  info.description = absl::StrCat("cifar: ", s.train_count, " train, ", s.test_count, " test ",
                                  Shape(kCifarShape), " images, ", s.classes, " classes");
  return info;
}

// The first `count` records of `files`, pixels scaled to [0, 1].
absl::StatusOr<Examples> ReadCifar(const std::vector<CifarFile>& files, int64_t count) {
  Examples e;
  e.count = count;
  e.input_shape = kCifarShape;
  const std::string field = files.empty() ? "data" : files[0].file.field;
  if (auto st = Allocate(e.inputs, count * kCifarImageBytes, field, "the images"); !st.ok()) {
    return st;
  }
  e.targets.reserve(count);
  constexpr int64_t kChunk = 512;  // records per read
  std::vector<unsigned char> buf(kChunk * kCifarRecordBytes);
  int64_t done = 0;
  for (const CifarFile& c : files) {
    if (done == count) break;
    Fd fd(c.file.path);
    if (fd.fd < 0) return Invalid(c.file, CannotOpen());
    for (int64_t r = 0; r < c.records && done < count;) {
      const int64_t n = std::min({kChunk, c.records - r, count - done});
      if (!ReadAt(fd.fd, r * kCifarRecordBytes, buf.data(), n * kCifarRecordBytes)) {
        return Invalid(c.file,
                       absl::StrCat("truncated or unreadable at record ", r, " of ", c.records,
                                    " (the file changed since it was checked?)"));
      }
      for (int64_t i = 0; i < n; ++i) {
        const unsigned char* rec = buf.data() + i * kCifarRecordBytes;
        if (rec[0] != c.labels[r + i]) {
          return Invalid(c.file, absl::StrCat("changed since it was checked (label of record ",
                                              r + i, "); submit the job again"));
        }
        e.targets.push_back(rec[0]);
        float* out = e.inputs.data() + (done + i) * kCifarImageBytes;
        for (int64_t p = 0; p < kCifarImageBytes; ++p) out[p] = rec[1 + p] / 255.0f;
      }
      r += n, done += n;
    }
  }
  return e;
}

absl::StatusOr<DataInfo> InspectCifar(const v1::DataSpec& d) {
  auto s = OpenCifarSplits(d);
  if (!s.ok()) return s.status();
  return CifarDataInfo(*s);
}

absl::StatusOr<Data> LoadCifar(const v1::DataSpec& d) {
  auto s = OpenCifarSplits(d);
  if (!s.ok()) return s.status();
  Data out;
  out.info = CifarDataInfo(*s);
  auto train = ReadCifar(s->train, s->train_count);
  if (!train.ok()) return train.status();
  auto test = ReadCifar(s->test, s->test_count);
  if (!test.ok()) return test.status();
  out.train = std::move(*train);
  out.test = std::move(*test);
  if (d.has_normalize() && !d.normalize()) {
    out.normalisation = "none (pixel / 255)";
    out.channels.assign(kCifarShape[0], Normalisation{});
  } else {
    const int64_t channels = kCifarShape[0], plane = kCifarImageBytes / channels;
    const std::vector<Normalisation> stats =
        ChannelStats(out.train.inputs, out.train.count, channels, plane);
    NormaliseChannels(out.train.inputs, out.train.count, stats, plane);
    NormaliseChannels(out.test.inputs, out.test.count, stats, plane);
    out.channels = stats;
    auto join = [&](float Normalisation::*field) {
      return absl::StrJoin(stats, ", ", [&](std::string* o, const Normalisation& n) {
        absl::StrAppend(o, n.*field);
      });
    };
    out.normalisation = absl::StrCat("per-channel mean [", join(&Normalisation::mean), "] std [",
                                     join(&Normalisation::std), "] (training pixels)");
  }
  return out;
}

// ---------------------------------------------------------------------------
// text.

// How a corpus of `bytes` bytes splits, every split holding at least one
// context plus one byte.
struct TextSplits {
  DataFile file;
  int64_t bytes = 0, train_bytes = 0, test_bytes = 0, context = 0;
  double fraction = 0;
  int64_t train_count = 0, test_count = 0;
};

absl::StatusOr<TextSplits> SplitText(const v1::DataSpec& d, int64_t bytes) {
  TextSplits s;
  s.file = {d.path(), "data.path"};
  s.bytes = bytes;
  s.context = d.context() != 0 ? d.context() : kDefaultTextContext;
  if (s.context < 1 || s.context > kMaxTextContext) {
    return Invalid("data.context", absl::StrCat(d.context(), " is not in 1..", kMaxTextContext,
                                                " (tokens per example)"));
  }
  s.fraction = d.validation_fraction() != 0 ? d.validation_fraction() : kDefaultValidationFraction;
  if (!(s.fraction > 0 && s.fraction < 1)) {
    return Invalid("data.validation_fraction",
                   absl::StrCat(d.validation_fraction(), " is not in (0, 1)"));
  }
  s.test_bytes = std::llround(static_cast<double>(bytes) * s.fraction);
  s.train_bytes = bytes - s.test_bytes;
  const int64_t need = s.context + 1;
  for (bool train : {true, false}) {
    const int64_t have = train ? s.train_bytes : s.test_bytes;
    if (have >= need) continue;
    const std::string split =
        train ? absl::StrCat("the training split (all but the last validation_fraction ",
                             s.fraction, ")")
              : absl::StrCat("the test split (the last validation_fraction ", s.fraction, ")");
    std::vector<std::string> fixes;
    if (have >= 2) fixes.push_back(absl::StrCat("data.context ", have - 1, " or less"));
    fixes.push_back(train ? "a smaller data.validation_fraction"
                          : "a larger data.validation_fraction");
    fixes.push_back(absl::StrCat("a corpus longer than ", bytes, " bytes"));
    return Invalid(
        s.file, absl::StrCat("corpus too short: ", split, " of its ", bytes, " bytes holds ", have,
                             have == 1 ? " byte" : " bytes", ", but data.context ", s.context,
                             " needs at least ", need, " (one context plus the next byte); use ",
                             absl::StrJoin(fixes, ", or ")));
  }
  s.train_count = Limited((s.train_bytes - 1) / s.context, d.train_limit());
  s.test_count = Limited((s.test_bytes - 1) / s.context, d.test_limit());
  return s;
}

DataInfo TextDataInfo(const TextSplits& s) {
  DataInfo info;
  info.task = Task::kLanguageModel;
  info.input_shape = {s.context};
  info.classes = 256;
  info.train_count = s.train_count;
  info.test_count = s.test_count;
  info.description =
      absl::StrCat("text: ", s.file.path, ", ", s.bytes, " bytes: ", s.train_count, " train, ",
                   s.test_count, " test windows of ", s.context, " bytes, 256-byte vocabulary");
  return info;
}

constexpr const char* kCorpus = "; for type text data.path is the corpus itself, a plain-text file";

absl::StatusOr<int64_t> CorpusSize(const v1::DataSpec& d) {
  if (d.path().empty()) return Invalid("data.path", absl::StrCat("required", kCorpus));
  auto size = FileSize({d.path(), "data.path"}, "a file", kCorpus);
  if (!size.ok()) return size.status();
  if (*size == 0) return Invalid(DataFile{d.path(), "data.path"}, "empty file (0 bytes)");
  return size;
}

absl::StatusOr<DataInfo> InspectText(const v1::DataSpec& d) {
  auto size = CorpusSize(d);
  if (!size.ok()) return size.status();
  auto s = SplitText(d, *size);
  if (!s.ok()) return s.status();
  return TextDataInfo(*s);
}

// `count` windows of `context` bytes from `bytes`, each with its next bytes.
absl::StatusOr<Examples> TextWindows(const unsigned char* bytes, int64_t count, int64_t context,
                                     const std::string& field) {
  Examples e;
  e.count = count;
  e.input_shape = {context};
  e.target_shape = {context};
  if (auto st = Allocate(e.tokens, count * context, field, "the tokens"); !st.ok()) return st;
  if (auto st = Allocate(e.targets, count * context, field, "the targets"); !st.ok()) return st;
  for (int64_t i = 0; i < count * context; ++i) {
    e.tokens[i] = bytes[i];
    e.targets[i] = bytes[i + 1];
  }
  return e;
}

absl::StatusOr<Data> LoadText(const v1::DataSpec& d) {
  auto size = CorpusSize(d);
  if (!size.ok()) return size.status();
  const DataFile f{d.path(), "data.path"};
  std::vector<unsigned char> bytes;
  if (auto st = Allocate(bytes, *size, f.field, f.path); !st.ok()) return st;
  Fd fd(f.path);
  if (fd.fd < 0) return Invalid(f, CannotOpen());
  if (!ReadAt(fd.fd, 0, bytes.data(), *size)) {
    return Invalid(f, absl::StrCat("read error or truncated: expected ", *size,
                                   " bytes (the file changed while being read?)"));
  }
  auto s = SplitText(d, *size);
  if (!s.ok()) return s.status();
  Data out;
  out.info = TextDataInfo(*s);
  auto train = TextWindows(bytes.data(), s->train_count, s->context, f.field);
  if (!train.ok()) return train.status();
  auto test = TextWindows(bytes.data() + s->train_bytes, s->test_count, s->context, f.field);
  if (!test.ok()) return test.status();
  out.train = std::move(*train);
  out.test = std::move(*test);
  return out;
}

}  // namespace

int64_t Examples::InputSize() const {
  int64_t n = 1;
  for (int64_t s : input_shape) n *= s;
  return n;
}

int64_t Examples::TargetSize() const {
  int64_t n = 1;
  for (int64_t s : target_shape) n *= s;
  return n;
}

absl::StatusOr<DataInfo> InspectData(const v1::DataSpec& d) {
  auto kind = ParseDataKind(d.type());
  if (!kind.ok()) return kind.status();
  switch (*kind) {
    case DataKind::kIdx:
    case DataKind::kMnist:
      return InspectIdxData(d);
    case DataKind::kCifar:
      return InspectCifar(d);
    case DataKind::kText:
      return InspectText(d);
  }
  return absl::InternalError("data.type: unhandled");
}

absl::StatusOr<Data> LoadData(const v1::DataSpec& d) {
  auto kind = ParseDataKind(d.type());
  if (!kind.ok()) return kind.status();
  switch (*kind) {
    case DataKind::kIdx:
    case DataKind::kMnist:
      return LoadIdxData(d);
    case DataKind::kCifar:
      return LoadCifar(d);
    case DataKind::kText:
      return LoadText(d);
  }
  return absl::InternalError("data.type: unhandled");
}

absl::StatusOr<std::vector<DataFile>> DataFilesOf(const v1::DataSpec& d) {
  auto kind = ParseDataKind(d.type());
  if (!kind.ok()) return kind.status();
  switch (*kind) {
    case DataKind::kIdx:
    case DataKind::kMnist: {
      const IdxFiles f = ResolveIdxFiles(d);
      return std::vector<DataFile>{f.train_images, f.train_labels, f.test_images, f.test_labels};
    }
    case DataKind::kCifar: {
      auto train = CifarFiles(d, true);
      if (!train.ok()) return train.status();
      auto test = CifarFiles(d, false);
      if (!test.ok()) return test.status();
      train->insert(train->end(), test->begin(), test->end());
      return *std::move(train);
    }
    case DataKind::kText:
      return std::vector<DataFile>{{d.path(), "data.path"}};
  }
  return absl::InternalError("data.type: unhandled");
}

namespace {

// Size and SHA-256 of `f`, read in 1 MiB blocks.
absl::StatusOr<v1::DataFile> DescribeFile(const DataFile& f) {
  auto size = FileSize(f, "a data file", "");
  if (!size.ok()) return size.status();
  const int fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Invalid(f, CannotOpen());
  Sha256 hash;
  std::vector<char> block(1 << 20);
  int64_t read_bytes = 0;
  while (true) {
    const ssize_t n = ::read(fd, block.data(), block.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      return Invalid(f, absl::StrCat("read failed (", why, ")"));
    }
    if (n == 0) break;
    hash.Update(block.data(), static_cast<size_t>(n));
    read_bytes += n;
  }
  ::close(fd);
  v1::DataFile out;
  out.set_path(f.path);
  out.set_field(f.field);
  out.set_size(read_bytes);
  out.set_sha256(hash.Hex());
  return out;
}

template <typename T>
void Gather(const std::vector<T>& from, int64_t size, const std::vector<int64_t>& order,
            int64_t begin, int64_t count, std::vector<T>& to) {
  to.resize(static_cast<size_t>(count * size));
  for (int64_t j = 0; j < count; ++j) {
    const int64_t src = order.empty() ? begin + j : order[begin + j];
    std::copy_n(from.data() + src * size, size, to.data() + j * size);
  }
}

}  // namespace

absl::StatusOr<std::vector<v1::DataFile>> ManifestOfData(const v1::DataSpec& d) {
  auto files = DataFilesOf(d);
  if (!files.ok()) return files.status();
  std::vector<v1::DataFile> out;
  for (const DataFile& f : *files) {
    auto described = DescribeFile(f);
    if (!described.ok()) return described.status();
    out.push_back(*std::move(described));
  }
  return out;
}

absl::Status CheckDataManifest(const v1::DataSpec& d,
                               const google::protobuf::RepeatedPtrField<v1::DataFile>& manifest) {
  auto files = DataFilesOf(d);
  if (!files.ok()) return files.status();
  if (static_cast<int>(files->size()) != manifest.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: this host resolves ", files->size(), " files of the job's data, the coordinator ",
        manifest.size(), "; give every worker that reads data the same files as the coordinator"));
  }
  for (int i = 0; i < manifest.size(); ++i) {
    const DataFile& f = (*files)[i];
    const v1::DataFile& want = manifest[i];
    const std::string fix =
        "; give this host the coordinator's copy (a shared volume, or the same file under its "
        "--data-root)";
    if (f.path != want.path()) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.field, ": this host resolves ", f.path, ", the coordinator ", want.path(),
                       "; start the worker in the same directory or use absolute paths"));
    }
    // The size first: a shorter or longer copy is told without reading it.
    auto size = FileSize(f, "a data file", "");
    if (!size.ok()) return absl::InvalidArgumentError(absl::StrCat(size.status().message(), fix));
    if (*size != want.size()) {
      return absl::InvalidArgumentError(absl::StrCat(f.field, ": ", f.path, " is ", *size,
                                                     " bytes here, ", want.size(),
                                                     " bytes on the coordinator", fix));
    }
    auto got = DescribeFile(f);
    if (!got.ok()) return absl::InvalidArgumentError(absl::StrCat(got.status().message(), fix));
    if (got->sha256() != want.sha256()) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.field, ": ", f.path, " differs from the coordinator's (SHA-256 ",
                       got->sha256(), " here, ", want.sha256(), " there)", fix));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDataUnchanged(const std::vector<v1::DataFile>& now,
                                const google::protobuf::RepeatedPtrField<v1::DataFile>& first) {
  const std::string fix =
      "; a recovery or resume goes on at its checkpoint's position in the data, which in other "
      "files would be other examples: put back the files the job started with, or submit a new "
      "job (--init-from its checkpoint keeps the weights)";
  if (static_cast<int>(now.size()) != first.size()) {
    return absl::InvalidArgumentError(absl::StrCat("data: ", now.size(), " files now, ",
                                                   first.size(), " when the job started", fix));
  }
  for (int i = 0; i < first.size(); ++i) {
    const v1::DataFile &f = now[i], &was = first[i];
    if (f.path() != was.path()) {
      return absl::InvalidArgumentError(absl::StrCat(f.field(), ": resolves to ", f.path(),
                                                     " now, ", was.path(), " when the job started",
                                                     fix));
    }
    if (f.size() != was.size() || f.sha256() != was.sha256()) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.field(), ": ", f.path(), " changed since the job started (", was.size(),
                       " bytes, SHA-256 ", was.sha256(), " then; ", f.size(), " bytes, SHA-256 ",
                       f.sha256(), " now)", fix));
    }
  }
  return absl::OkStatus();
}

Batch GatherInputs(const Examples& split, const std::vector<int64_t>& order, int64_t begin,
                   int64_t count) {
  Batch b;
  b.shape.push_back(count);
  b.shape.insert(b.shape.end(), split.input_shape.begin(), split.input_shape.end());
  if (split.token_input()) {
    Gather(split.tokens, split.InputSize(), order, begin, count, b.ints);
  } else {
    Gather(split.inputs, split.InputSize(), order, begin, count, b.floats);
  }
  return b;
}

Batch GatherTargets(const Examples& split, const std::vector<int64_t>& order, int64_t begin,
                    int64_t count) {
  Batch b;
  b.shape.push_back(count);
  b.shape.insert(b.shape.end(), split.target_shape.begin(), split.target_shape.end());
  Gather(split.targets, split.TargetSize(), order, begin, count, b.ints);
  return b;
}

}  // namespace pipemare
