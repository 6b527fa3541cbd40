#include "pipeline/torch_codec.h"

#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "pipeline/settings.h"
#include "pipeline/tensor_codec.h"

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

absl::StatusOr<torch::Tensor> ToTorch(const v1::Tensor& wire) {
  if (auto st = ValidateTensor(wire); !st.ok()) return st;
  std::vector<int64_t> shape(wire.shape().begin(), wire.shape().end());
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(*TorchType(wire.dtype())));
  if (!wire.data().empty()) std::memcpy(t.data_ptr(), wire.data().data(), wire.data().size());
  return t;
}

absl::StatusOr<torch::Tensor> TakeTorch(v1::Tensor* wire, std::optional<torch::ScalarType> as) {
  if (auto st = ValidateTensor(*wire); !st.ok()) return st;
  std::vector<int64_t> shape(wire->shape().begin(), wire->shape().end());
  const auto options = torch::TensorOptions().dtype(*TorchType(wire->dtype()));
  // The tensor owns the string; heap strings are at least 16-byte aligned.
  auto* bytes = new std::string(std::move(*wire->mutable_data()));
  wire->clear_data();
  torch::Tensor t = torch::from_blob(
      bytes->data(), shape, [bytes](void*) { delete bytes; }, options);
  if (as && t.is_floating_point() && t.scalar_type() != *as) t = t.to(*as);
  return t;
}

std::optional<torch::ScalarType> WireScalarType(const std::string& wire_dtype) {
  switch (WireDtypeOf(wire_dtype)) {
    case WireDtype::kFloat16:
      return torch::kFloat16;
    case WireDtype::kBFloat16:
      return torch::kBFloat16;
    case WireDtype::kFloat32:
      break;
  }
  return std::nullopt;
}

absl::StatusOr<v1::Tensor> FromTorch(const torch::Tensor& tensor,
                                     std::optional<torch::ScalarType> as) {
  if (as && tensor.is_floating_point() && tensor.scalar_type() != *as) {
    return FromTorch(tensor.detach().to(torch::kCPU).to(*as));
  }
  const v1::DType dtype = WireDType(tensor.scalar_type());
  if (dtype == v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor dtype ", c10::toString(tensor.scalar_type()), " has no wire encoding"));
  }
  torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
  v1::Tensor wire;
  wire.set_dtype(dtype);
  for (int64_t d : cpu.sizes()) wire.add_shape(d);
  wire.set_data(static_cast<const char*>(cpu.data_ptr()), cpu.numel() * cpu.element_size());
  return wire;
}

}  // namespace pipemare
