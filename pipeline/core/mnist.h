// Image datasets from idx files (data.type "idx", and "mnist", which is the
// same loader on MNIST's files with MNIST's fixed normalisation). Files may be
// plain or gzipped (zlib recognises gzip by its magic bytes 1f 8b). No
// LibTorch: the coordinator feeds data.
#ifndef PIPEMARE_PIPELINE_MNIST_H_
#define PIPEMARE_PIPELINE_MNIST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// One split: `count` images of rows x cols pixels, normalised (see
// Normalisation), row-major float32, and labels.
struct ImageDataset {
  int64_t count = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> pixels;    // count * rows * cols
  std::vector<int64_t> labels;  // count
  int64_t features() const { return rows * cols; }
};

// A pixel byte p becomes (p / 255 - mean) / std.
struct Normalisation {
  float mean = 0;
  float std = 1;
};
// MNIST's: data.type "mnist" (and LoadIdxPair, LoadMnist) always use it.
inline constexpr Normalisation kMnistNormalisation{0.1307f, 0.3081f};

// Helpers every data.type shares (pipeline/core/data.cc uses them too).
//
// Each channel's mean and (population) standard deviation over `count`
// examples of `pixels` (in [0, 1]) laid out as `channels` planes of `plane`
// values; std 1 where a channel is constant (or there are no examples).
std::vector<Normalisation> ChannelStats(const std::vector<float>& pixels, int64_t count,
                                        int64_t channels, int64_t plane);
// pixels = (pixels - mean[c]) / std[c], channel by channel, in place.
void NormaliseChannels(std::vector<float>& pixels, int64_t count,
                       const std::vector<Normalisation>& channels, int64_t plane);
// `path` from a data spec: a relative one is resolved against `dir`
// (data.path) when that is set.
std::string ResolveDataPath(const std::string& dir, const std::string& path);
// The first `limit` of `count` examples (limit <= 0: all).
inline int64_t Limited(int64_t count, int64_t limit) {
  return limit > 0 && limit < count ? limit : count;
}

// File names of the four standard files inside a data directory (each may
// also be present gzipped, with ".gz" appended).
inline constexpr const char* kMnistTrainImages = "train-images-idx3-ubyte";
inline constexpr const char* kMnistTrainLabels = "train-labels-idx1-ubyte";
inline constexpr const char* kMnistTestImages = "t10k-images-idx3-ubyte";
inline constexpr const char* kMnistTestLabels = "t10k-labels-idx1-ubyte";

// Reads an idx3 image file and its idx1 label file, plain or gzipped, with
// MNIST's normalisation and labels 0..9. Errors name the file and the fault
// (missing, bad magic number, truncated, corrupt gzip, count mismatch, bad
// label). `limit` > 0 keeps only the first `limit` examples.
absl::StatusOr<ImageDataset> LoadIdxPair(const std::string& images_path,
                                         const std::string& labels_path, int64_t limit);

// Loads the train (`train` = true) or test split from an MNIST directory
// (the standard names, plain or with ".gz").
absl::StatusOr<ImageDataset> LoadMnist(const std::string& dir, bool train, int64_t limit);

// One of a job's four files: its path, and the spec field it comes from
// ("data.path" for a standard name in the directory, else "data.train_images"
// and so on), which errors name.
struct DataFile {
  std::string path;
  std::string field;
};
struct IdxFiles {
  DataFile train_images, train_labels, test_images, test_labels;
};

// The four files of a data spec: the explicit file fields (relative ones
// resolved against data.path when set), else the standard names in data.path,
// each plain or, if only that exists, with ".gz". Does not open them.
IdxFiles ResolveIdxFiles(const v1::DataSpec& data);

// Both splits of a job's data, normalised; `classes` is 10 for "mnist" and
// max(label) + 1 over the whole training label file for "idx" (every loaded
// test label is below it). "idx" normalises with the mean and standard
// deviation of the loaded training pixels (after train_limit; std 1 if they
// are all equal), or not at all (mean 0, std 1: p / 255) when data.normalize
// is false. Errors start with the spec field and name the file.
struct Dataset {
  ImageDataset train, test;
  int64_t classes = 0;
  Normalisation normalisation;
};
absl::StatusOr<Dataset> LoadDataset(const v1::DataSpec& data);

// What the headers and label files of a job's idx data say (the checks of
// CheckDataset without the model): the four files exist, their headers are
// valid idx with matching image and label counts and equal image sizes in
// both splits; the training label file gives the classes (see Dataset) and
// the test labels in use must be below it. Counts are after
// data.train_limit / data.test_limit. Pixel data is not read.
struct IdxInfo {
  IdxFiles files;
  int64_t rows = 0, cols = 0, classes = 0;
  int64_t train_count = 0, test_count = 0;
};
absl::StatusOr<IdxInfo> InspectIdx(const v1::DataSpec& data);

// The submit-time check of a job's data against its model, cheap enough for
// an RPC: the four files exist, their headers are valid idx with matching
// image and label counts and equal image sizes in both splits; the label files
// are read (labels are small) for the class count and bad labels. Refuses a
// model whose model.layers[0] is not rows x cols or whose last width is below
// the class count. Pixel data is not read, so truncated images surface when
// the job starts.
absl::Status CheckDataset(const v1::JobSpec& spec);

// The model against its data: model.layers[0] must be rows x cols and the
// last width at least `classes`. Errors name the layer and the file the
// number comes from. Through CheckDataset, which PlanModel (pipeline/model/model_plan.h)
// runs for an MLP on idx files at submit and again when the job starts.
absl::Status CheckModelFitsData(const v1::ModelSpec& model, const IdxFiles& files, int64_t rows,
                                int64_t cols, int64_t classes);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_MNIST_H_
