// MNIST from its original idx files (no LibTorch: the coordinator feeds data).
#ifndef PIPEMARE_PIPELINE_MNIST_H_
#define PIPEMARE_PIPELINE_MNIST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pipemare {

// One split: `count` images of rows x cols pixels, normalised with MNIST's
// mean 0.1307 and standard deviation 0.3081, row-major float32, and labels.
struct ImageDataset {
  int64_t count = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> pixels;    // count * rows * cols
  std::vector<int64_t> labels;  // count
  int64_t features() const { return rows * cols; }
};

// File names of the four MNIST files inside a data directory.
inline constexpr const char* kMnistTrainImages = "train-images-idx3-ubyte";
inline constexpr const char* kMnistTrainLabels = "train-labels-idx1-ubyte";
inline constexpr const char* kMnistTestImages = "t10k-images-idx3-ubyte";
inline constexpr const char* kMnistTestLabels = "t10k-labels-idx1-ubyte";

// Reads an idx3 image file and its idx1 label file. Errors name the file and
// the fault (missing, bad magic number, truncated, count mismatch, bad label).
// `limit` > 0 keeps only the first `limit` examples.
absl::StatusOr<ImageDataset> LoadIdxPair(const std::string& images_path,
                                         const std::string& labels_path, int64_t limit);

// Loads the train (`train` = true) or test split from an MNIST directory.
absl::StatusOr<ImageDataset> LoadMnist(const std::string& dir, bool train, int64_t limit);

// Cheap check used at submit time: all four files exist with valid headers.
absl::Status CheckMnistDir(const std::string& dir);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_MNIST_H_
