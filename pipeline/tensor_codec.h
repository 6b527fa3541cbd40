// The tensor wire format (pipemare.v1.Tensor): dtype, shape, raw
// little-endian bytes, row-major. This header needs no LibTorch, so that the
// coordinator and client can build tensors; torch_codec.h converts to and
// from torch::Tensor with the same validation.
#ifndef PIPEMARE_PIPELINE_TENSOR_CODEC_H_
#define PIPEMARE_PIPELINE_TENSOR_CODEC_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// Bytes per element of `dtype`; 0 for DTYPE_UNSPECIFIED or unknown values.
int ElementSize(v1::DType dtype);

// Number of elements of `shape`, or an error for negative dimensions or
// overflow.
absl::StatusOr<int64_t> ElementCount(const google::protobuf::RepeatedField<int64_t>& shape);

// OK iff dtype is known, no dimension is negative, there are at most 8
// dimensions, and data.size() == elements * ElementSize(dtype). The message
// says which of these broke, with the numbers.
absl::Status ValidateTensor(const v1::Tensor& tensor);
// The same checks for a tensor whose data travels apart from it (the Pipe
// stream's payload slices): `data_bytes` stands for data().size().
absl::Status ValidateTensorLayout(const v1::Tensor& tensor, int64_t data_bytes);

// Builders for the coordinator's data feed.
v1::Tensor MakeFloat32Tensor(const float* data, const std::vector<int64_t>& shape);
v1::Tensor MakeInt64Tensor(const int64_t* data, const std::vector<int64_t>& shape);

// Reads the values of a validated tensor of the given dtype (the host is
// little-endian; checked at compile time).
absl::StatusOr<std::vector<float>> Float32Values(const v1::Tensor& tensor);
absl::StatusOr<std::vector<int64_t>> Int64Values(const v1::Tensor& tensor);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_TENSOR_CODEC_H_
