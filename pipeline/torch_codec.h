// torch::Tensor <-> pipemare.v1.Tensor, with ValidateTensor's checks on the
// way in.
//
// Copies of a payload between two stages (docs/architecture.md, transport):
//   send:    FromTorch copies the tensor into the message's bytes (1; with a
//            wire dtype the conversion is that pass plus the copy), then gRPC
//            serialises the message into its own buffers (1, gRPC's);
//   receive: gRPC parses its buffers into the message's bytes (1, gRPC's),
//            then TakeTorch hands those very bytes to the tensor (0).
#ifndef PIPEMARE_PIPELINE_TORCH_CODEC_H_
#define PIPEMARE_PIPELINE_TORCH_CODEC_H_

#include <torch/torch.h>

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// Validates `wire` and returns a CPU tensor owning a copy of its data.
absl::StatusOr<torch::Tensor> ToTorch(const v1::Tensor& wire);

// Validates `wire` and moves its bytes into the returned CPU tensor, with no
// copy (`wire` is left without data). With `as` (a floating type), floating
// payloads are converted to it (a copy, needed for a compressed wire dtype).
absl::StatusOr<torch::Tensor> TakeTorch(v1::Tensor* wire,
                                        std::optional<torch::ScalarType> as = std::nullopt);

// Encodes `tensor` (any device, made contiguous on CPU first). With `as` (a
// floating type), a floating tensor is converted to it on the way.
// INVALID_ARGUMENT for a dtype the wire format lacks.
absl::StatusOr<v1::Tensor> FromTorch(const torch::Tensor& tensor,
                                     std::optional<torch::ScalarType> as = std::nullopt);

// schedule.wire_dtype -> the type activations and gradients travel as;
// nullopt for "" and "float32" (no conversion).
std::optional<torch::ScalarType> WireScalarType(const std::string& wire_dtype);

// The wire dtype of a torch scalar type, or DTYPE_UNSPECIFIED.
v1::DType WireDType(torch::ScalarType type);
// The torch scalar type of a wire dtype, or nullopt.
std::optional<torch::ScalarType> TorchType(v1::DType dtype);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_TORCH_CODEC_H_
