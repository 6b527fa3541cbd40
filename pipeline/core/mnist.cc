#include "pipeline/core/mnist.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "pipeline/core/file_access.h"
#include "pipeline/core/settings.h"

namespace pipemare {
namespace {

int64_t BigEndian(const unsigned char* b) {
  return (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | b[3];
}

// "field: message", or the message alone for a file not from a spec.
absl::Status Fail(const DataFile& f, absl::StatusCode code, const std::string& message) {
  return absl::Status(code, f.field.empty() ? message : absl::StrCat(f.field, ": ", message));
}
absl::Status Invalid(const DataFile& f, const std::string& message) {
  return Fail(f, absl::StatusCode::kInvalidArgument, message);
}

struct GzClose {
  void operator()(gzFile_s* f) const { gzclose(f); }
};

// An open idx file (plain or gzipped) whose header has been read and checked:
// sizes[i] is dimension i's size.
struct IdxReader {
  DataFile file;
  std::unique_ptr<gzFile_s, GzClose> gz;
  std::vector<int64_t> sizes;
};

// Reads up to `n` bytes into `out`, growing it with what arrives, so a header
// that promises too much costs no more memory than the file holds. Returns
// the bytes read; fewer than `n` means the file ended. Corrupt gzip data and
// read errors are errors.
absl::StatusOr<int64_t> ReadUpTo(IdxReader& r, int64_t n, std::vector<unsigned char>& out) {
  int64_t got = 0;
  out.clear();
  while (got < n) {
    const int64_t want = std::min({n - got, std::max<int64_t>(got, 1 << 16), int64_t{1} << 30});
    out.resize(got + want);
    const int read = gzread(r.gz.get(), out.data() + got, static_cast<unsigned>(want));
    if (read > 0) got += read;
    if (read < want) break;
  }
  out.resize(got);
  int err = Z_OK;
  // zlib's message starts with the path: keep only the fault. Z_BUF_ERROR is
  // gzip data that ends mid-stream.
  absl::string_view message = gzerror(r.gz.get(), &err);
  absl::ConsumePrefix(&message, r.file.path + ": ");
  if (err != Z_OK) {
    return Invalid(r.file,
                   gzdirect(r.gz.get())
                       ? absl::StrCat(r.file.path, ": read error (", message, ")")
                       : absl::StrCat(r.file.path, ": corrupt gzip data (zlib: ", message, ")"));
  }
  return got;
}

// Opens an idx file of unsigned bytes with `dims` dimensions and reads its
// header. zlib tells gzip (magic bytes 1f 8b) from a plain file by content.
absl::StatusOr<IdxReader> OpenIdx(const DataFile& f, int dims) {
  // A missing file gets the hints below; one that exists must be a regular
  // file the job may read (never a FIFO that blocks the open).
  if (std::error_code ec; std::filesystem::exists(f.path, ec)) {
    if (auto access = CheckReadableFile(f.path, f.field); !access.ok()) return access;
  }
  IdxReader r{f, std::unique_ptr<gzFile_s, GzClose>(gzopen(f.path.c_str(), "rb")), {}};
  if (!r.gz) {
    std::string hint;
    if (f.field == "data.path") {
      hint = absl::StrCat("; data.path must be a directory holding ", kMnistTrainImages, ", ",
                          kMnistTrainLabels, ", ", kMnistTestImages, " and ", kMnistTestLabels,
                          " (each plain or .gz; scripts/dev.sh fetches MNIST into data/mnist)");
    }
    return Fail(f, absl::StatusCode::kNotFound,
                absl::StrCat(f.path, ": file not found or unreadable", hint));
  }
  gzbuffer(r.gz.get(), 1 << 17);
  std::vector<unsigned char> header;
  auto got = ReadUpTo(r, 4 + 4 * dims, header);
  if (!got.ok()) return got.status();
  if (*got >= 4) {
    const int64_t magic = BigEndian(header.data());
    const int64_t expected = 0x0800 + dims;
    if (magic != expected) {
      return Invalid(
          f, absl::StrCat(f.path, ": bad magic number 0x", absl::Hex(magic, absl::kZeroPad8),
                          ", expected 0x", absl::Hex(expected, absl::kZeroPad8),
                          " (an idx file of unsigned bytes with ", dims, " dimensions)"));
    }
  }
  if (*got < 4 + 4 * dims) {
    return Invalid(
        f, absl::StrCat(f.path, ": truncated idx header (", *got, " of ", 4 + 4 * dims, " bytes)"));
  }
  for (int i = 0; i < dims; ++i) r.sizes.push_back(BigEndian(header.data() + 4 + 4 * i));
  return r;
}

// An image file and its label file, headers checked against each other.
struct IdxPair {
  IdxReader images, labels;
  int64_t count() const { return images.sizes[0]; }
  int64_t rows() const { return images.sizes[1]; }
  int64_t cols() const { return images.sizes[2]; }
};

absl::StatusOr<IdxPair> OpenPair(const DataFile& images_file, const DataFile& labels_file) {
  auto images = OpenIdx(images_file, 3);
  if (!images.ok()) return images.status();
  const int64_t count = images->sizes[0], rows = images->sizes[1], cols = images->sizes[2];
  // Caps that keep count * rows * cols well inside int64.
  if (rows < 1 || cols < 1 || rows > (1 << 16) || cols > (1 << 16) ||
      count > (int64_t{1} << 50) / (rows * cols)) {
    return Invalid(images_file, absl::StrCat(images_file.path, ": corrupt header: ", count,
                                             " images of ", rows, "x", cols, " pixels"));
  }
  auto labels = OpenIdx(labels_file, 1);
  if (!labels.ok()) return labels.status();
  if (labels->sizes[0] != count) {
    return Invalid(images_file,
                   absl::StrCat(images_file.path, " has ", count, " images but ", labels_file.path,
                                " has ", labels->sizes[0], " labels"));
  }
  return IdxPair{std::move(*images), std::move(*labels)};
}

// The first `n` labels (all of them if `n` <= 0).
absl::StatusOr<std::vector<int64_t>> ReadLabels(IdxReader& r, int64_t n) {
  if (n <= 0 || n > r.sizes[0]) n = r.sizes[0];
  std::vector<unsigned char> raw;
  auto got = ReadUpTo(r, n, raw);
  if (!got.ok()) return got.status();
  if (*got < n) {
    return Invalid(r.file, absl::StrCat(r.file.path, ": truncated: the header promises ", n,
                                        " labels but the file holds only ", *got));
  }
  return std::vector<int64_t>(raw.begin(), raw.end());
}

// One split, pixels scaled to [0, 1] (not yet normalised).
absl::StatusOr<ImageDataset> LoadSplit(const DataFile& images_file, const DataFile& labels_file,
                                       int64_t limit) {
  auto pair = OpenPair(images_file, labels_file);
  if (!pair.ok()) return pair.status();
  ImageDataset ds;
  ds.count = Limited(pair->count(), limit);
  ds.rows = pair->rows();
  ds.cols = pair->cols();
  const int64_t n = ds.count * ds.features();  // <= 2^50 (OpenPair)
  std::vector<unsigned char> raw;
  auto got = ReadUpTo(pair->images, n, raw);
  if (!got.ok()) return got.status();
  if (*got < n) {
    return Invalid(images_file,
                   absl::StrCat(images_file.path, ": truncated: the header promises ", ds.count,
                                " images of ", ds.rows, "x", ds.cols, " pixels (", n,
                                " bytes) but the file holds only ", *got, " pixel bytes"));
  }
  ds.pixels.resize(n);
  for (int64_t i = 0; i < n; ++i) ds.pixels[i] = raw[i] / 255.0f;
  auto labels = ReadLabels(pair->labels, ds.count);
  if (!labels.ok()) return labels.status();
  ds.labels = std::move(*labels);
  return ds;
}

// Every label is below `classes`; `what` says what the classes are.
absl::Status CheckLabels(const std::vector<int64_t>& labels, int64_t classes, const DataFile& f,
                         const std::string& what) {
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] >= classes) {
      return Invalid(
          f, absl::StrCat(f.path, ": label ", labels[i], " at index ", i, " is not ", what));
    }
  }
  return absl::OkStatus();
}
constexpr const char* kDigits = "a digit 0..9";

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

absl::Status RequirePaths(const IdxFiles& f) {
  for (const DataFile* file : {&f.train_images, &f.train_labels, &f.test_images, &f.test_labels}) {
    if (file->path.empty()) return Invalid(*file, "required (a file path)");
  }
  return absl::OkStatus();
}

// The class count: 10 for MNIST (whose labels must be digits), else
// max(label) + 1 over the whole training label file.
absl::StatusOr<int64_t> CountClasses(const v1::DataSpec& d, const DataFile& train_labels) {
  auto labels_file = OpenIdx(train_labels, 1);
  if (!labels_file.ok()) return labels_file.status();
  auto labels = ReadLabels(*labels_file, 0);
  if (!labels.ok()) return labels.status();
  if (DataKindOf(d.type()) == DataKind::kMnist) {
    if (auto st = CheckLabels(*labels, 10, train_labels, kDigits); !st.ok()) return st;
    return 10;
  }
  if (labels->empty()) return Invalid(train_labels, absl::StrCat(train_labels.path, ": no labels"));
  return *std::max_element(labels->begin(), labels->end()) + 1;
}

std::string ClassesText(int64_t classes, const DataFile& train_labels) {
  return absl::StrCat("one of the ", classes, " classes of ", train_labels.path, " (0..",
                      classes - 1, ")");
}

}  // namespace

std::vector<Normalisation> ChannelStats(const std::vector<float>& pixels, int64_t count,
                                        int64_t channels, int64_t plane) {
  std::vector<Normalisation> out(channels);
  if (count == 0) return out;
  for (int64_t c = 0; c < channels; ++c) {
    double sum = 0, squares = 0;
    for (int64_t i = 0; i < count; ++i) {
      const float* p = pixels.data() + (i * channels + c) * plane;
      for (int64_t k = 0; k < plane; ++k) sum += p[k], squares += double{p[k]} * p[k];
    }
    const double n = static_cast<double>(count) * plane;
    const double mean = sum / n;
    const double std = std::sqrt(std::max(0.0, squares / n - mean * mean));
    out[c] = {static_cast<float>(mean), std > 1e-6 ? static_cast<float>(std) : 1.0f};
  }
  return out;
}

void NormaliseChannels(std::vector<float>& pixels, int64_t count,
                       const std::vector<Normalisation>& channels, int64_t plane) {
  const int64_t C = static_cast<int64_t>(channels.size());
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t c = 0; c < C; ++c) {
      float* p = pixels.data() + (i * C + c) * plane;
      for (int64_t k = 0; k < plane; ++k) p[k] = (p[k] - channels[c].mean) / channels[c].std;
    }
  }
}

std::string ResolveDataPath(const std::string& dir, const std::string& path) {
  const bool relative = !path.empty() && path.front() != '/';
  return relative && !dir.empty() ? Join(dir, path) : path;
}

absl::StatusOr<ImageDataset> LoadIdxPair(const std::string& images_path,
                                         const std::string& labels_path, int64_t limit) {
  const DataFile labels_file{labels_path, ""};
  auto ds = LoadSplit({images_path, ""}, labels_file, limit);
  if (!ds.ok()) return ds.status();
  if (auto st = CheckLabels(ds->labels, 10, labels_file, kDigits); !st.ok()) return st;
  NormaliseChannels(ds->pixels, ds->count, {kMnistNormalisation}, ds->features());
  return ds;
}

absl::StatusOr<ImageDataset> LoadMnist(const std::string& dir, bool train, int64_t limit) {
  v1::DataSpec spec;
  spec.set_path(dir);
  const IdxFiles f = ResolveIdxFiles(spec);
  return train ? LoadIdxPair(f.train_images.path, f.train_labels.path, limit)
               : LoadIdxPair(f.test_images.path, f.test_labels.path, limit);
}

IdxFiles ResolveIdxFiles(const v1::DataSpec& d) {
  if (!d.train_images().empty() || !d.train_labels().empty() || !d.test_images().empty() ||
      !d.test_labels().empty()) {
    auto in_dir = [&](const std::string& p, const char* field) {
      return DataFile{ResolveDataPath(d.path(), p), field};
    };
    return {in_dir(d.train_images(), "data.train_images"),
            in_dir(d.train_labels(), "data.train_labels"),
            in_dir(d.test_images(), "data.test_images"),
            in_dir(d.test_labels(), "data.test_labels")};
  }
  auto standard = [&](const char* name) {
    const std::string plain = Join(d.path(), name), gz = plain + ".gz";
    std::error_code ec;
    const bool use_gz =
        !std::filesystem::exists(plain, ec) && std::filesystem::exists(gz, ec) && !ec;
    return DataFile{use_gz ? gz : plain, "data.path"};
  };
  return {standard(kMnistTrainImages), standard(kMnistTrainLabels), standard(kMnistTestImages),
          standard(kMnistTestLabels)};
}

absl::StatusOr<Dataset> LoadDataset(const v1::DataSpec& d) {
  const IdxFiles f = ResolveIdxFiles(d);
  if (auto st = RequirePaths(f); !st.ok()) return st;
  auto classes = CountClasses(d, f.train_labels);
  if (!classes.ok()) return classes.status();
  const bool mnist = DataKindOf(d.type()) == DataKind::kMnist;
  const std::string labels_are = mnist ? kDigits : ClassesText(*classes, f.train_labels);
  auto train = LoadSplit(f.train_images, f.train_labels, d.train_limit());
  if (!train.ok()) return train.status();
  auto test = LoadSplit(f.test_images, f.test_labels, d.test_limit());
  if (!test.ok()) return test.status();
  if (test->rows != train->rows || test->cols != train->cols) {
    return Invalid(f.test_images, absl::StrCat(f.test_images.path, " has images of ", test->rows,
                                               "x", test->cols, " pixels but ", f.train_images.path,
                                               " has ", train->rows, "x", train->cols));
  }
  if (auto st = CheckLabels(test->labels, *classes, f.test_labels, labels_are); !st.ok()) {
    return st;
  }
  Dataset out;
  out.classes = *classes;
  if (mnist) {
    out.normalisation = kMnistNormalisation;
  } else if (d.has_normalize() && !d.normalize()) {
    out.normalisation = Normalisation{};  // p / 255
  } else {
    out.normalisation = ChannelStats(train->pixels, train->count, 1, train->features())[0];
  }
  NormaliseChannels(train->pixels, train->count, {out.normalisation}, train->features());
  NormaliseChannels(test->pixels, test->count, {out.normalisation}, test->features());
  out.train = std::move(*train);
  out.test = std::move(*test);
  return out;
}

absl::StatusOr<IdxInfo> InspectIdx(const v1::DataSpec& d) {
  IdxInfo info;
  info.files = ResolveIdxFiles(d);
  const IdxFiles& f = info.files;
  if (auto st = RequirePaths(f); !st.ok()) return st;
  auto train = OpenPair(f.train_images, f.train_labels);
  if (!train.ok()) return train.status();
  auto test = OpenPair(f.test_images, f.test_labels);
  if (!test.ok()) return test.status();
  if (test->rows() != train->rows() || test->cols() != train->cols()) {
    return Invalid(f.test_images,
                   absl::StrCat(f.test_images.path, " has images of ", test->rows(), "x",
                                test->cols(), " pixels but ", f.train_images.path, " has ",
                                train->rows(), "x", train->cols()));
  }
  auto classes = CountClasses(d, f.train_labels);
  if (!classes.ok()) return classes.status();
  auto test_labels = ReadLabels(test->labels, d.test_limit());
  if (!test_labels.ok()) return test_labels.status();
  if (auto st = CheckLabels(*test_labels, *classes, f.test_labels,
                            DataKindOf(d.type()) == DataKind::kMnist
                                ? kDigits
                                : ClassesText(*classes, f.train_labels));
      !st.ok()) {
    return st;
  }
  info.rows = train->rows();
  info.cols = train->cols();
  info.classes = *classes;
  info.train_count = Limited(train->count(), d.train_limit());
  info.test_count = Limited(test->count(), d.test_limit());
  return info;
}

absl::Status CheckDataset(const v1::JobSpec& spec) {
  auto info = InspectIdx(spec.data());
  if (!info.ok()) return info.status();
  return CheckModelFitsData(spec.model(), info->files, info->rows, info->cols, info->classes);
}

absl::Status CheckModelFitsData(const v1::ModelSpec& model, const IdxFiles& f, int64_t rows,
                                int64_t cols, int64_t classes) {
  const auto& layers = model.layers();
  const int64_t pixels = rows * cols;
  if (layers.empty()) return absl::InvalidArgumentError("model.layers: required");
  if (layers[0] != pixels) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.layers[0]: is ", layers[0], " but the images of ", f.train_images.path,
                     " have ", rows, "x", cols, " = ", pixels, " pixels; use ", pixels));
  }
  const int last = layers.size() - 1;
  if (layers[last] < classes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.layers[", last, "]: is ", layers[last], " but ", f.train_labels.path, " has ",
        classes, " classes (labels 0..", classes - 1, "); use at least ", classes));
  }
  return absl::OkStatus();
}

}  // namespace pipemare
