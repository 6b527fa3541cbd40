// Every data.type behind one interface, as the coordinator feeds it: "idx" and
// "mnist" (idx image/label files, pipeline/core/mnist.h), "cifar" (CIFAR-10 binary
// batches) and "text" (a plain-text corpus, byte-level language modelling).
// No LibTorch. Shuffling is the coordinator's.
//
// Errors are INVALID_ARGUMENT (idx files: NOT_FOUND for a missing file, as
// pipeline/core/mnist.h; RESOURCE_EXHAUSTED for data that does not fit in memory)
// starting with the spec field ("data.path", "data.train_files[2]",
// "data.context"), then the file and the fault, and, where there is one, the
// fix. Nothing here trusts a file: every size is checked before it is used.
#ifndef PIPEMARE_PIPELINE_DATA_H_
#define PIPEMARE_PIPELINE_DATA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/core/mnist.h"
#include "pipeline/core/settings.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// data.type "text": tokens per example and held-out fraction when unset.
inline constexpr int64_t kDefaultTextContext = 64;
inline constexpr double kDefaultValidationFraction = 0.1;
inline constexpr int64_t kMaxTextContext = 65536;
// data.type "cifar": a record is 1 label byte, then 3 x 32 x 32 pixel bytes
// (red, green, blue planes, each row-major).
inline constexpr int64_t kCifarImageBytes = 3 * 32 * 32;
inline constexpr int64_t kCifarRecordBytes = 1 + kCifarImageBytes;

// One split as the coordinator feeds it: `count` examples, each an input of
// `input_shape` and a target of `target_shape` (empty = one class id).
struct Examples {
  int64_t count = 0;
  // Per example: {1, rows, cols} idx and mnist, {3, 32, 32} cifar, {T} text.
  std::vector<int64_t> input_shape;
  // Images: count * InputSize() floats, example-major, normalised.
  std::vector<float> inputs;
  // Text: count * InputSize() token ids (the bytes, 0..255).
  std::vector<int64_t> tokens;
  // count * TargetSize(): the class id of each image; for text, the next
  // byte at each position (example i's targets are its input shifted by one).
  std::vector<int64_t> targets;
  // {} for classification, {T} for text.
  std::vector<int64_t> target_shape;

  // Text: inputs are token ids (a rank-1 input shape); images: floats.
  bool token_input() const { return input_shape.size() == 1; }
  int64_t InputSize() const;   // product of input_shape
  int64_t TargetSize() const;  // product of target_shape (1 if empty)
};

// What a job's data is, cheap enough for a submit RPC: file headers, file
// sizes, label files and CIFAR's label bytes; no pixel bodies, no corpus.
struct DataInfo {
  Task task = Task::kClassification;
  std::vector<int64_t> input_shape;  // per example
  // Language models read INT64 token ids; images are float.
  bool token_input() const { return task == Task::kLanguageModel; }
  // Image classes (idx: max(label) + 1 over the whole training label file,
  // cifar: over all training records, mnist: 10); 256 (bytes) for text.
  int64_t classes = 0;
  // Examples per split after data.train_limit / data.test_limit.
  int64_t train_count = 0, test_count = 0;
  // One line for logs, e.g.
  // "cifar: 50000 train, 10000 test 3x32x32 images, 10 classes".
  std::string description;
};

// Checks everything that is cheap about a job's data and describes it:
// idx: the four headers and both label files (pipeline/core/mnist.h); cifar: each
// file exists and holds whole records, every label byte (the classes; test
// labels in use below them); text: the corpus exists and each split holds at
// least one context plus one byte. Does not read pixels or the corpus.
absl::StatusOr<DataInfo> InspectData(const v1::DataSpec& data);

// Both splits, loaded. Checks everything InspectData checks again (the files
// may have changed since the submit), and what only reading finds.
struct Data {
  Examples train, test;
  DataInfo info;
  // How images were normalised, for logs: "per-channel mean [0.491, 0.482,
  // 0.447] std [0.247, 0.243, 0.262] (training pixels)", "mean 0.1307 std
  // 0.3081 (MNIST's)", "none (pixel / 255)"; empty for text.
  std::string normalisation;
  // The same as numbers, per channel: pixel byte p became (p / 255 - mean) /
  // std (exported with the model, so that it can be used outside). Empty
  // for text.
  std::vector<Normalisation> channels;
};

// Loads a job's data (data.type idx, mnist, cifar or text):
//   images: pixel bytes p become (p / 255 - mean[c]) / std[c], with channel
//     c's mean and (population) standard deviation over the training pixels
//     in use (after data.train_limit; std 1 where a channel is constant).
//     data.normalize false: p / 255. "mnist": MNIST's fixed 0.1307, 0.3081.
//   cifar: files in order (data.train_files, else data_batch_1.bin ..
//     data_batch_5.bin in data.path, those present; data.test_files, else
//     test_batch.bin), data.*_limit keeping the first records.
//   text: byte-level. The last validation_fraction (default 0.1) of the bytes,
//     rounded to a whole byte, is the test split, the rest the training split.
//     Each split of B bytes gives (B - 1) / T examples of context T (default
//     64), non-overlapping: example i's input is bytes [i*T, i*T + T), its
//     targets bytes [i*T + 1, i*T + T + 1).
absl::StatusOr<Data> LoadData(const v1::DataSpec& data);

// The files LoadData reads for `data`, resolved, each with the spec field
// that names it: idx and mnist's four, cifar's batches, text's corpus. Does
// not open them.
absl::StatusOr<std::vector<DataFile>> DataFilesOf(const v1::DataSpec& data);

// What a worker checks its own copy of the data against: each of the files,
// its size and SHA-256 (read in full). Errors as LoadData's.
absl::StatusOr<std::vector<v1::DataFile>> ManifestOfData(const v1::DataSpec& data);

// OK when this host's files of `data` are those of `manifest`: the same
// paths, sizes and SHA-256. Otherwise INVALID_ARGUMENT (the job fails: no
// retry on the same files helps) naming the field, the file, what differs
// and the fix (the worker adds its host).
absl::Status CheckDataManifest(const v1::DataSpec& data,
                               const google::protobuf::RepeatedPtrField<v1::DataFile>& manifest);

// OK when `now` (ManifestOfData on the coordinator at a run's start) is the
// job's data as its first run read it (`first`); else INVALID_ARGUMENT
// naming the field and the file that changed, and the fix.
absl::Status CheckDataUnchanged(const std::vector<v1::DataFile>& now,
                                const google::protobuf::RepeatedPtrField<v1::DataFile>& first);

// Examples [begin, begin + count) of `split` by `order` (empty: in order),
// side by side: inputs (floats, or token ids for text) of shape
// {count, input_shape...}, or targets of shape {count, target_shape...}.
struct Batch {
  std::vector<int64_t> shape;
  std::vector<float> floats;  // image inputs
  std::vector<int64_t> ints;  // token inputs, and targets
};
Batch GatherInputs(const Examples& split, const std::vector<int64_t>& order, int64_t begin,
                   int64_t count);
Batch GatherTargets(const Examples& split, const std::vector<int64_t>& order, int64_t begin,
                    int64_t count);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_DATA_H_
