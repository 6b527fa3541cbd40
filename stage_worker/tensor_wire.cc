#include "stage_worker/tensor_wire.h"

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/buffer_pool.h"

namespace pipemare {

std::optional<torch::ScalarType> TorchType(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return torch::kFloat32;
    case v1::FLOAT64:
      return torch::kFloat64;
    case v1::FLOAT16:
      return torch::kFloat16;
    case v1::BFLOAT16:
      return torch::kBFloat16;
    case v1::INT64:
      return torch::kInt64;
    case v1::INT32:
      return torch::kInt32;
    case v1::UINT8:
      return torch::kUInt8;
    case v1::BOOL:
      return torch::kBool;
    default:
      return std::nullopt;
  }
}

v1::DType WireDType(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat32:
      return v1::FLOAT32;
    case torch::kFloat64:
      return v1::FLOAT64;
    case torch::kFloat16:
      return v1::FLOAT16;
    case torch::kBFloat16:
      return v1::BFLOAT16;
    case torch::kInt64:
      return v1::INT64;
    case torch::kInt32:
      return v1::INT32;
    case torch::kUInt8:
      return v1::UINT8;
    case torch::kBool:
      return v1::BOOL;
    default:
      return v1::DTYPE_UNSPECIFIED;
  }
}

std::optional<torch::ScalarType> SendAs(WireDtype dtype) {
  if (dtype == WireDtype::kFloat32) return std::nullopt;
  return TorchType(PeerDType(dtype));
}

absl::StatusOr<WireTensor> ToWire(const torch::Tensor& tensor,
                                  std::optional<torch::ScalarType> as) {
  torch::Tensor t = tensor.detach();
  if (as && t.is_floating_point() && t.scalar_type() != *as) t = t.to(torch::kCPU).to(*as);
  const v1::DType dtype = WireDType(t.scalar_type());
  if (dtype == v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor dtype ", c10::toString(t.scalar_type()), " has no wire encoding"));
  }
  t = t.to(torch::kCPU).contiguous();  // no copy for a contiguous CPU tensor
  WireTensor w;
  w.header.set_dtype(dtype);
  for (int64_t d : t.sizes()) w.header.add_shape(d);
  w.payload.data = t.data_ptr();
  w.payload.size = static_cast<size_t>(t.numel()) * t.element_size();
  // The slice holds the tensor (and so its storage) until gRPC is done.
  w.payload.owner = std::make_shared<torch::Tensor>(std::move(t));
  return w;
}

absl::StatusOr<torch::Tensor> EmptyForReceive(const std::vector<int64_t>& shape,
                                              torch::ScalarType type) {
  const auto options = torch::TensorOptions().dtype(type);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * torch::elementSize(type);
  if (bytes < BufferPool::kMinBytes) return torch::empty(shape, options);
  std::shared_ptr<uint8_t> buffer = BufferPool::Receive().Take(bytes);
  if (buffer == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no memory for a received tensor of ", bytes, " bytes"));
  }
  uint8_t* data = buffer.get();
  // The tensor owns the buffer; freeing it hands the buffer back to the pool.
  return torch::from_blob(
      data, shape, [buffer = std::move(buffer)](void*) mutable { buffer.reset(); }, options);
}

absl::StatusOr<torch::Tensor> FromWire(const PipeMessage& message,
                                       std::optional<torch::ScalarType> as) {
  const v1::Tensor* wire = PayloadTensor(message.message);
  if (wire == nullptr) return absl::InvalidArgumentError("the message carries no tensor");
  const auto type = TorchType(wire->dtype());
  if (!type) return absl::InvalidArgumentError("tensor.dtype: unknown");
  std::vector<int64_t> shape(wire->shape().begin(), wire->shape().end());
  const auto options = torch::TensorOptions().dtype(*type);
  torch::Tensor t;
  const int64_t element = torch::elementSize(*type);
  if (message.data.size() == 1 &&
      reinterpret_cast<uintptr_t>(message.data[0].begin()) % element == 0) {
    // One slice: the tensor adopts gRPC's buffer (read-only to gRPC, ours now).
    auto* slice = new grpc::Slice(message.data[0]);
    t = torch::from_blob(
        const_cast<uint8_t*>(slice->begin()), shape, [slice](void*) { delete slice; }, options);
  } else {
    auto empty = EmptyForReceive(shape, *type);
    if (!empty.ok()) return empty.status();
    t = std::move(*empty);
    if (message.data_size > 0) message.CopyData(t.data_ptr());
  }
  if (as && t.is_floating_point() && t.scalar_type() != *as) t = t.to(*as);
  return t;
}

}  // namespace pipemare
