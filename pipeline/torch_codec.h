// torch::Tensor <-> pipemare.v1.Tensor, with ValidateTensor's checks on the
// way in. Payloads are copied once each way (into/out of the proto's bytes).
#ifndef PIPEMARE_PIPELINE_TORCH_CODEC_H_
#define PIPEMARE_PIPELINE_TORCH_CODEC_H_

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// Validates `wire` and returns a CPU tensor owning a copy of its data.
absl::StatusOr<torch::Tensor> ToTorch(const v1::Tensor& wire);

// Encodes `tensor` (any device, made contiguous on CPU first). INVALID_ARGUMENT
// for a dtype the wire format lacks.
absl::StatusOr<v1::Tensor> FromTorch(const torch::Tensor& tensor);

// The wire dtype of a torch scalar type, or DTYPE_UNSPECIFIED.
v1::DType WireDType(torch::ScalarType type);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_TORCH_CODEC_H_
