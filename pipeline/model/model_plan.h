// What a job's model is, as the coordinator sees it without LibTorch in its
// headers: the types flowing between units, each unit's shapes and
// parameters, and PlanModel, the submit-time check of a model against its
// data (implemented with LibTorch in pipeline/model/model.cc, library
// pipemare_model).
#ifndef PIPEMARE_PIPELINE_MODEL_PLAN_H_
#define PIPEMARE_PIPELINE_MODEL_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/core/data.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// What flows into or out of a unit, per example: its shape (without the
// batch dimension) and whether it holds INT64 token ids instead of floats.
struct TensorType {
  std::vector<int64_t> shape;
  bool tokens = false;
};
std::string ShapeString(const TensorType& t);  // e.g. "[B, 1, 28, 28]", "[B, 64] tokens"

struct UnitInfo {
  std::string name;  // e.g. "conv2d", "residual", "transformer_block", "Linear"
  TensorType in, out;
  int64_t parameters = 0;
};

// A per-example input shape that arrived over RPC (a stage assignment, a
// profile request): 1..8 dimensions, each in 1..2^24, and `batch` examples
// of it at most 2^31 elements. INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckExampleShape(const std::vector<int64_t>& shape, int64_t batch,
                               const std::string& field);

// A job's model checked against its data, before any stage is loaded: the
// zoo resolved from the data (ResolveModel), a TorchScript file read, the
// shape pass run on the data's example shape, the last unit's output checked
// against the task (classification: [classes] or wider; language model:
// [context, vocab] or wider vocab), schedule.stages and schedule.split
// checked against the unit count; an MLP on idx files first by CheckDataset
// (pipeline/core/mnist.h), whose errors name the file. Errors name the field or
// unit and the fix.
struct ModelPlan {
  v1::ModelSpec model;      // resolved: what the stages are sent
  std::string torchscript;  // the file's bytes, for torchscript models
  TensorType input;         // per example, of unit 0
  std::vector<UnitInfo> units;
};
// The coordinator's --max-model-bytes default: the float32 parameters one
// job's model may take (1 Gi parameters), checked unit by unit before each
// is built (ShapePass in pipeline/model/model.h).
constexpr int64_t kDefaultMaxModelBytes = int64_t{4} << 30;
absl::StatusOr<ModelPlan> PlanModel(const v1::JobSpec& spec, const DataInfo& data,
                                    int64_t max_model_bytes = kDefaultMaxModelBytes);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_MODEL_PLAN_H_
