// What the one-process benchmarks (bench_single, bench_delay_tolerance)
// share: an MNIST split as tensors over the dataset's own storage, the very
// MLP a Pipemare job builds (pipeline::BuildUnits: same seed, same initial
// weights), and its test accuracy.
#ifndef PIPEMARE_BENCH_MNIST_MLP_H_
#define PIPEMARE_BENCH_MNIST_MLP_H_

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "pipeline/core/mnist.h"
#include "pipeline/model/model.h"

namespace pipemare::bench {

// Images [count, rows·cols] float32 and labels [count] int64, viewing
// `d`'s vectors (no copy): `d` must outlive them.
struct SplitTensors {
  torch::Tensor x, y;
};
inline SplitTensors AsTensors(ImageDataset& d) {
  return {torch::from_blob(d.pixels.data(), {d.count, d.features()}, torch::kFloat32),
          torch::from_blob(d.labels.data(), {d.count}, torch::kInt64)};
}

// All units of `model`, built as a job's stages would build them.
inline absl::StatusOr<torch::nn::Sequential> BuildMlp(const v1::ModelSpec& model, int64_t seed) {
  auto net =
      BuildUnits(model, 0, model.layers_size() - 1, seed, TensorType{{model.layers(0)}, false});
  if (!net.ok()) return net.status();
  return net->module;
}

// The share of `split`'s examples whose most likely class is the label.
inline double TestAccuracy(torch::nn::Sequential& mlp, const SplitTensors& split) {
  torch::NoGradGuard no_grad;
  return mlp->forward(split.x).argmax(1).eq(split.y).sum().item<double>() /
         static_cast<double>(split.y.size(0));
}

}  // namespace pipemare::bench

#endif  // PIPEMARE_BENCH_MNIST_MLP_H_
