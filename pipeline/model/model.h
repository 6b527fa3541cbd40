// Models as sequences of units: the zoo (mlp, resnet, transformer_lm), the
// explicit layer list (sequential) and TorchScript import, built unit by unit
// so that any contiguous range of units can be one pipeline stage, and the
// shape pass that checks a whole chain before a job starts.
//
// A unit's input sizes are read off the previous unit's output: each unit is
// built, then run once on a one-example zero input (eval mode, no grad) to
// learn its output shape. The shape pass does that for the whole chain at
// submit time and names the unit that does not fit.
#ifndef PIPEMARE_PIPELINE_MODEL_H_
#define PIPEMARE_PIPELINE_MODEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/model/model_plan.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

struct BuiltUnits {
  torch::nn::Sequential module;  // one child per unit
  std::vector<UnitInfo> units;
};

// Builds units [first_unit, first_unit + units) of `model`, whose first unit
// receives `input`. Unit u's weights are drawn from a generator seeded with
// (seed, u), so initial weights do not depend on the partition.
// `torchscript` holds the file's bytes for model.type "torchscript".
// INVALID_ARGUMENT naming the unit (model.units[i], model.layers[i], or
// "unit i (Name)" for zoo and TorchScript models) and both shapes when a unit
// does not fit its input.
absl::StatusOr<BuiltUnits> BuildUnits(const v1::ModelSpec& model, int first_unit, int units,
                                      int64_t seed, const TensorType& input,
                                      const std::string& torchscript = "");

// Number of units; for torchscript, read from the file's bytes.
absl::StatusOr<int> CountUnits(const v1::ModelSpec& model, const std::string& torchscript);

// The whole chain on `input`: every unit's shapes and parameters. The last
// unit must give per-example logits: [classes] for classification, or
// [T, vocab] for language models (T = the input's context). With
// `max_model_bytes` > 0, the model's float32 parameters may take at most
// that many bytes: each unit is checked by arithmetic before it is built
// (INVALID_ARGUMENT naming the unit and the coordinator's --max-model-bytes).
absl::StatusOr<std::vector<UnitInfo>> ShapePass(const v1::ModelSpec& model, const TensorType& input,
                                                const std::string& torchscript = "",
                                                int64_t max_model_bytes = 0);

// Reads a TorchScript file for model.path; INVALID_ARGUMENT naming model.path
// if it cannot be read, is not TorchScript, or is not an nn.Sequential with
// at least one child.
// With `max_model_bytes` > 0 a larger file is refused before it is read.
absl::StatusOr<std::string> ReadTorchScript(const std::string& path, int64_t max_model_bytes = 0);

// Per unit of the whole model, median seconds of one microbatch's forward
// and backward (the backward recomputes the forward, as training does), on
// `device`, with random inputs of `microbatch_size` examples.
struct UnitCosts {
  std::vector<double> forward_seconds, backward_seconds;
  std::vector<int64_t> parameters;
};
absl::StatusOr<UnitCosts> ProfileUnits(const v1::ModelSpec& model, const std::string& torchscript,
                                       const TensorType& input, int64_t vocab, int microbatch_size,
                                       int repeats, int64_t seed,
                                       torch::Device device = torch::kCPU);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_MODEL_H_
