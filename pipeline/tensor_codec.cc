#include "pipeline/tensor_codec.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pipemare {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian; add byte swapping for this host");

int ElementSize(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return 4;
    case v1::FLOAT64:
      return 8;
    case v1::FLOAT16:
      return 2;
    case v1::BFLOAT16:
      return 2;
    case v1::INT64:
      return 8;
    case v1::INT32:
      return 4;
    case v1::UINT8:
      return 1;
    case v1::BOOL:
      return 1;
    default:
      return 0;
  }
}

absl::StatusOr<int64_t> ElementCount(const google::protobuf::RepeatedField<int64_t>& shape) {
  int64_t n = 1;
  for (int i = 0; i < shape.size(); ++i) {
    const int64_t d = shape.Get(i);
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor.shape[", i, "] is negative (", d, ")"));
    }
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      return absl::InvalidArgumentError("tensor.shape: element count overflows");
    }
    n *= d;
  }
  return n;
}

absl::Status ValidateTensor(const v1::Tensor& tensor) {
  return ValidateTensorLayout(tensor, static_cast<int64_t>(tensor.data().size()));
}

absl::Status ValidateTensorLayout(const v1::Tensor& tensor, int64_t data_bytes) {
  const int size = ElementSize(tensor.dtype());
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.dtype: unknown dtype ", static_cast<int>(tensor.dtype()),
                     "; allowed: FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT64, INT32, UINT8, BOOL"));
  }
  if (tensor.shape_size() > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.shape: ", tensor.shape_size(), " dimensions; at most 8 allowed"));
  }
  auto n = ElementCount(tensor.shape());
  if (!n.ok()) return n.status();
  if (*n > std::numeric_limits<int64_t>::max() / size) {
    return absl::InvalidArgumentError("tensor.shape: byte count overflows");
  }
  const int64_t expected = *n * size;
  if (data_bytes != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.data: ", data_bytes, " bytes but shape and dtype need ", expected,
                     data_bytes < expected ? " (truncated payload)" : " (size/shape mismatch)"));
  }
  return absl::OkStatus();
}

namespace {
template <typename T>
v1::Tensor Make(v1::DType dtype, const T* data, const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  t.set_data(reinterpret_cast<const char*>(data), n * sizeof(T));
  return t;
}
template <typename T>
absl::StatusOr<std::vector<T>> Values(const v1::Tensor& tensor, v1::DType dtype) {
  if (auto st = ValidateTensor(tensor); !st.ok()) return st;
  if (tensor.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat("tensor.dtype: expected ", v1::DType_Name(dtype),
                                                   ", got ", v1::DType_Name(tensor.dtype())));
  }
  std::vector<T> out(tensor.data().size() / sizeof(T));
  // An empty tensor (a 0 in its shape) has no storage to copy into.
  if (!out.empty()) std::memcpy(out.data(), tensor.data().data(), tensor.data().size());
  return out;
}
}  // namespace

v1::Tensor MakeFloat32Tensor(const float* data, const std::vector<int64_t>& shape) {
  return Make(v1::FLOAT32, data, shape);
}
v1::Tensor MakeInt64Tensor(const int64_t* data, const std::vector<int64_t>& shape) {
  return Make(v1::INT64, data, shape);
}
absl::StatusOr<std::vector<float>> Float32Values(const v1::Tensor& tensor) {
  return Values<float>(tensor, v1::FLOAT32);
}
absl::StatusOr<std::vector<int64_t>> Int64Values(const v1::Tensor& tensor) {
  return Values<int64_t>(tensor, v1::INT64);
}

}  // namespace pipemare
