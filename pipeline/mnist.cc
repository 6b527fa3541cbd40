#include "pipeline/mnist.h"

#include <fstream>

#include "absl/strings/str_cat.h"

namespace pipemare {
namespace {

constexpr float kMean = 0.1307f;
constexpr float kStd = 0.3081f;

uint32_t BigEndian(const unsigned char* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
}

struct IdxHeader {
  int dims = 0;
  std::vector<uint32_t> sizes;
};

absl::StatusOr<IdxHeader> ReadHeader(std::ifstream& in, const std::string& path,
                                     int expected_dims) {
  unsigned char magic[4];
  if (!in.read(reinterpret_cast<char*>(magic), 4)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated idx header"));
  }
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08 || magic[3] != expected_dims) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not an idx file of unsigned bytes with ", expected_dims,
                     " dimensions (bad magic number); is this the uncompressed MNIST file?"));
  }
  IdxHeader h;
  h.dims = expected_dims;
  for (int i = 0; i < expected_dims; ++i) {
    unsigned char b[4];
    if (!in.read(reinterpret_cast<char*>(b), 4)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": truncated idx header"));
    }
    h.sizes.push_back(BigEndian(b));
  }
  return h;
}

absl::StatusOr<std::ifstream> Open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(path, ": file not found or unreadable"));
  }
  return in;
}

std::string Join(const std::string& dir, const char* name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

}  // namespace

absl::StatusOr<ImageDataset> LoadIdxPair(const std::string& images_path,
                                         const std::string& labels_path, int64_t limit) {
  auto images = Open(images_path);
  if (!images.ok()) return images.status();
  auto labels = Open(labels_path);
  if (!labels.ok()) return labels.status();
  auto ih = ReadHeader(*images, images_path, 3);
  if (!ih.ok()) return ih.status();
  auto lh = ReadHeader(*labels, labels_path, 1);
  if (!lh.ok()) return lh.status();
  if (ih->sizes[0] != lh->sizes[0]) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, " has ", ih->sizes[0],
                                                   " images but ", labels_path, " has ",
                                                   lh->sizes[0], " labels"));
  }
  ImageDataset ds;
  ds.count = ih->sizes[0];
  ds.rows = ih->sizes[1];
  ds.cols = ih->sizes[2];
  if (limit > 0 && limit < ds.count) ds.count = limit;
  // Check the file holds what the header claims before allocating for it.
  const auto header_end = images->tellg();
  images->seekg(0, std::ios::end);
  const int64_t available = static_cast<int64_t>(images->tellg() - header_end);
  images->seekg(header_end);
  const int64_t n = ds.count * ds.features();
  if (ds.rows > (1 << 16) || ds.cols > (1 << 16) || n > available) {
    return absl::InvalidArgumentError(absl::StrCat(
        images_path, ": truncated: the header claims ", ds.count, " images of ", ds.rows, "x",
        ds.cols, " pixels but the file holds only ", available, " pixel bytes"));
  }
  std::vector<unsigned char> raw(n);
  if (!images->read(reinterpret_cast<char*>(raw.data()), n)) {
    return absl::InvalidArgumentError(
        absl::StrCat(images_path, ": truncated: expected ", n, " pixel bytes"));
  }
  ds.pixels.resize(n);
  for (int64_t i = 0; i < n; ++i) ds.pixels[i] = (raw[i] / 255.0f - kMean) / kStd;
  std::vector<unsigned char> raw_labels(ds.count);
  if (!labels->read(reinterpret_cast<char*>(raw_labels.data()), ds.count)) {
    return absl::InvalidArgumentError(
        absl::StrCat(labels_path, ": truncated: expected ", ds.count, " labels"));
  }
  ds.labels.resize(ds.count);
  for (int64_t i = 0; i < ds.count; ++i) {
    if (raw_labels[i] > 9) {
      return absl::InvalidArgumentError(absl::StrCat(labels_path, ": label ", int{raw_labels[i]},
                                                     " at index ", i, " is not a digit 0..9"));
    }
    ds.labels[i] = raw_labels[i];
  }
  return ds;
}

absl::StatusOr<ImageDataset> LoadMnist(const std::string& dir, bool train, int64_t limit) {
  return train ? LoadIdxPair(Join(dir, kMnistTrainImages), Join(dir, kMnistTrainLabels), limit)
               : LoadIdxPair(Join(dir, kMnistTestImages), Join(dir, kMnistTestLabels), limit);
}

absl::Status CheckMnistDir(const std::string& dir) {
  const std::pair<const char*, int> files[] = {
      {kMnistTrainImages, 3}, {kMnistTrainLabels, 1}, {kMnistTestImages, 3}, {kMnistTestLabels, 1}};
  for (const auto& [name, dims] : files) {
    const std::string path = Join(dir, name);
    auto in = Open(path);
    if (!in.ok()) {
      return absl::NotFoundError(
          absl::StrCat("data.path: ", path,
                       " not found; data.path must be a directory with the four MNIST idx "
                       "files (scripts/dev.sh fetches them into data/mnist)"));
    }
    auto h = ReadHeader(*in, path, dims);
    if (!h.ok())
      return absl::InvalidArgumentError(absl::StrCat("data.path: ", h.status().message()));
  }
  return absl::OkStatus();
}

}  // namespace pipemare
