// Tests of the wire codec (tensor_codec.h, no LibTorch) and of the torch
// conversion on top of it (torch_codec.h).
#include "pipeline/tensor_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "pipeline/torch_codec.h"

namespace pipemare {
namespace {

using ::testing::HasSubstr;

struct DTypeCase {
  v1::DType dtype;
  int size;
  torch::ScalarType torch_type;
};

const DTypeCase kDTypes[] = {
    {v1::FLOAT32, 4, torch::kFloat32}, {v1::FLOAT64, 8, torch::kFloat64},
    {v1::FLOAT16, 2, torch::kFloat16}, {v1::BFLOAT16, 2, torch::kBFloat16},
    {v1::INT64, 8, torch::kInt64},     {v1::INT32, 4, torch::kInt32},
    {v1::UINT8, 1, torch::kUInt8},     {v1::BOOL, 1, torch::kBool},
};

v1::Tensor Wire(v1::DType dtype, const std::vector<int64_t>& shape, size_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(bytes, '\x01'));
  return t;
}

// ---------------------------------------------------------------------------
// tensor_codec.h

TEST(ElementSizeTest, EveryDType) {
  for (const auto& c : kDTypes) {
    EXPECT_EQ(ElementSize(c.dtype), c.size) << v1::DType_Name(c.dtype);
  }
  EXPECT_EQ(ElementSize(v1::DTYPE_UNSPECIFIED), 0);
  EXPECT_EQ(ElementSize(static_cast<v1::DType>(99)), 0);
}

TEST(ElementCountTest, Products) {
  v1::Tensor t;
  EXPECT_EQ(*ElementCount(t.shape()), 1);  // a scalar
  t.add_shape(2);
  t.add_shape(3);
  t.add_shape(4);
  EXPECT_EQ(*ElementCount(t.shape()), 24);
  t.add_shape(0);
  EXPECT_EQ(*ElementCount(t.shape()), 0);
  t.add_shape(-1);
  EXPECT_EQ(ElementCount(t.shape()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ElementCountTest, Overflow) {
  v1::Tensor t;
  t.add_shape(std::numeric_limits<int64_t>::max() / 2);
  t.add_shape(4);
  auto n = ElementCount(t.shape());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("overflow"));
}

TEST(ValidateTensorTest, AcceptsCorrectPayloadForEveryDType) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    EXPECT_TRUE(ValidateTensor(Wire(c.dtype, {2, 3}, 6 * c.size)).ok());
    EXPECT_TRUE(ValidateTensor(Wire(c.dtype, {}, c.size)).ok());  // scalar
    EXPECT_TRUE(ValidateTensor(Wire(c.dtype, {0, 5}, 0)).ok());   // empty
    EXPECT_TRUE(ValidateTensor(Wire(c.dtype, {1, 1, 1, 1, 1, 1, 1, 2}, 2 * c.size)).ok());
  }
}

TEST(ValidateTensorTest, RejectsTruncatedPayload) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    absl::Status st = ValidateTensor(Wire(c.dtype, {2, 3}, 6 * c.size - 1));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(st.message()), HasSubstr("truncated"));
    EXPECT_THAT(std::string(st.message()), HasSubstr(std::to_string(6 * c.size)));
  }
  EXPECT_THAT(std::string(ValidateTensor(Wire(v1::FLOAT32, {4}, 0)).message()),
              HasSubstr("truncated"));
}

TEST(ValidateTensorTest, RejectsOversizePayload) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    absl::Status st = ValidateTensor(Wire(c.dtype, {2, 3}, 6 * c.size + 1));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(st.message()), HasSubstr("mismatch"));
  }
  EXPECT_THAT(std::string(ValidateTensor(Wire(v1::UINT8, {0}, 1)).message()),
              HasSubstr("mismatch"));
}

TEST(ValidateTensorTest, RejectsUnknownDType) {
  absl::Status st = ValidateTensor(Wire(static_cast<v1::DType>(99), {1}, 4));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("99"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("FLOAT32"));
  st = ValidateTensor(Wire(v1::DTYPE_UNSPECIFIED, {1}, 4));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("dtype"));
}

TEST(ValidateTensorTest, RejectsNegativeDimension) {
  absl::Status st = ValidateTensor(Wire(v1::FLOAT32, {2, -1}, 0));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("negative"));
  // Two negatives multiply to a positive count: still rejected.
  st = ValidateTensor(Wire(v1::FLOAT32, {-2, -2}, 16));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("negative"));
}

TEST(ValidateTensorTest, RejectsMoreThanEightDimensions) {
  absl::Status st = ValidateTensor(Wire(v1::FLOAT32, {1, 1, 1, 1, 1, 1, 1, 1, 1}, 4));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("at most 8"));
}

TEST(ValidateTensorTest, RejectsByteCountOverflow) {
  absl::Status st = ValidateTensor(Wire(v1::FLOAT64, {std::numeric_limits<int64_t>::max() / 4}, 8));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("overflow"));
}

TEST(TensorValuesTest, Float32RoundTrip) {
  const std::vector<float> values = {1.5f, -2.25f, 0.0f, 3.0e-8f, 1e30f, -0.0f};
  v1::Tensor t = MakeFloat32Tensor(values.data(), {2, 3});
  EXPECT_EQ(t.dtype(), v1::FLOAT32);
  EXPECT_THAT(std::vector<int64_t>(t.shape().begin(), t.shape().end()), testing::ElementsAre(2, 3));
  EXPECT_EQ(t.data().size(), 24u);
  EXPECT_TRUE(ValidateTensor(t).ok());
  auto back = Float32Values(t);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, values);
}

TEST(TensorValuesTest, Int64RoundTrip) {
  const std::vector<int64_t> values = {0, -1, 9, std::numeric_limits<int64_t>::max(),
                                       std::numeric_limits<int64_t>::min()};
  v1::Tensor t = MakeInt64Tensor(values.data(), {5});
  EXPECT_EQ(t.dtype(), v1::INT64);
  EXPECT_EQ(t.data().size(), 40u);
  auto back = Int64Values(t);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, values);
}

TEST(TensorValuesTest, EmptyAndScalar) {
  v1::Tensor empty = MakeFloat32Tensor(nullptr, {0, 784});
  auto e = Float32Values(empty);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(e->empty());
  const float one = 1.0f;
  v1::Tensor scalar = MakeFloat32Tensor(&one, {});
  EXPECT_EQ(scalar.shape_size(), 0);
  auto s = Float32Values(scalar);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, std::vector<float>{1.0f});
}

TEST(TensorValuesTest, DTypeMismatch) {
  const float f[2] = {1, 2};
  auto as_int = Int64Values(MakeFloat32Tensor(f, {2}));
  EXPECT_EQ(as_int.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(as_int.status().message()),
              testing::AllOf(HasSubstr("INT64"), HasSubstr("FLOAT32")));
  const int64_t i[1] = {1};
  auto as_float = Float32Values(MakeInt64Tensor(i, {1}));
  EXPECT_EQ(as_float.status().code(), absl::StatusCode::kInvalidArgument);
  // Same byte size, other dtype: still a mismatch.
  EXPECT_FALSE(Float32Values(Wire(v1::INT32, {2}, 8)).ok());
}

TEST(TensorValuesTest, InvalidTensorIsRejected) {
  auto v = Float32Values(Wire(v1::FLOAT32, {3}, 8));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("truncated"));
}

// ---------------------------------------------------------------------------
// torch_codec.h

torch::Tensor Sample(torch::ScalarType type, const std::vector<int64_t>& shape) {
  torch::manual_seed(3);
  if (type == torch::kBool) return torch::randint(0, 2, shape).to(torch::kBool);
  if (type == torch::kUInt8) return torch::randint(0, 256, shape).to(torch::kUInt8);
  if (type == torch::kInt32 || type == torch::kInt64) {
    return torch::randint(-1000000, 1000000, shape).to(type);
  }
  return (torch::randn(shape, torch::kFloat64) * 100).to(type);
}

void ExpectRoundTrip(const torch::Tensor& t, v1::DType dtype) {
  auto wire = FromTorch(t);
  ASSERT_TRUE(wire.ok()) << wire.status();
  EXPECT_EQ(wire->dtype(), dtype);
  EXPECT_EQ(std::vector<int64_t>(wire->shape().begin(), wire->shape().end()), t.sizes().vec());
  EXPECT_EQ(static_cast<int64_t>(wire->data().size()), t.numel() * ElementSize(dtype));
  EXPECT_TRUE(ValidateTensor(*wire).ok());
  auto back = ToTorch(*wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->scalar_type(), t.scalar_type());
  EXPECT_EQ(back->sizes(), t.sizes());
  EXPECT_TRUE(back->is_contiguous());
  EXPECT_TRUE(torch::equal(*back, t)) << *back << "\nvs\n" << t;
}

TEST(TorchCodecTest, WireDTypeMapping) {
  for (const auto& c : kDTypes) {
    EXPECT_EQ(WireDType(c.torch_type), c.dtype) << v1::DType_Name(c.dtype);
  }
  EXPECT_EQ(WireDType(torch::kComplexFloat), v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(WireDType(torch::kInt16), v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(WireDType(torch::kInt8), v1::DTYPE_UNSPECIFIED);
}

TEST(TorchCodecTest, RoundTripEveryDType) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    ExpectRoundTrip(Sample(c.torch_type, {3, 5}), c.dtype);
    ExpectRoundTrip(Sample(c.torch_type, {2, 1, 3, 2}), c.dtype);
  }
}

TEST(TorchCodecTest, RoundTripEmptyTensor) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    torch::Tensor t = torch::empty({0, 3}, torch::TensorOptions().dtype(c.torch_type));
    ExpectRoundTrip(t, c.dtype);
    auto wire = FromTorch(t);
    ASSERT_TRUE(wire.ok());
    EXPECT_TRUE(wire->data().empty());
  }
}

TEST(TorchCodecTest, RoundTripScalar) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    torch::Tensor t = Sample(c.torch_type, {}).reshape({});
    ASSERT_EQ(t.dim(), 0);
    ExpectRoundTrip(t, c.dtype);
    auto wire = FromTorch(t);
    ASSERT_TRUE(wire.ok());
    EXPECT_EQ(wire->shape_size(), 0);
  }
}

TEST(TorchCodecTest, RoundTripNonContiguous) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    torch::Tensor t = Sample(c.torch_type, {3, 4}).t();
    ASSERT_FALSE(t.is_contiguous());
    ExpectRoundTrip(t, c.dtype);
    // The bytes are the row-major order of the transposed view.
    auto wire = FromTorch(t);
    ASSERT_TRUE(wire.ok());
    torch::Tensor contiguous = t.contiguous();
    EXPECT_EQ(wire->data(), std::string(static_cast<const char*>(contiguous.data_ptr()),
                                        contiguous.numel() * contiguous.element_size()));
  }
  // A strided slice too.
  torch::Tensor base = torch::arange(20, torch::kFloat32).reshape({4, 5});
  torch::Tensor sliced = base.index({torch::indexing::Slice(), torch::indexing::Slice(1, 5, 2)});
  ExpectRoundTrip(sliced, v1::FLOAT32);
}

TEST(TorchCodecTest, KnownBytesDecode) {
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  auto t = ToTorch(MakeFloat32Tensor(values.data(), {2, 3}));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(torch::equal(*t, torch::tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}).reshape({2, 3})));
  EXPECT_EQ(t->device(), torch::Device(torch::kCPU));
}

TEST(TorchCodecTest, DecodedTensorOwnsItsData) {
  const std::vector<float> values = {1, 2};
  v1::Tensor wire = MakeFloat32Tensor(values.data(), {2});
  auto t = ToTorch(wire);
  ASSERT_TRUE(t.ok());
  wire.mutable_data()->assign(8, '\0');
  EXPECT_EQ((*t)[1].item<float>(), 2.0f);
}

TEST(TorchCodecTest, FromTorchDoesNotKeepGraph) {
  torch::Tensor w = torch::ones({2}, torch::requires_grad());
  auto wire = FromTorch(w * 3);
  ASSERT_TRUE(wire.ok()) << wire.status();
  auto back = ToTorch(*wire);
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(torch::equal(*back, torch::full({2}, 3.0f)));
  EXPECT_FALSE(back->requires_grad());
}

TEST(TorchCodecTest, ToTorchRejectsTruncated) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    auto t = ToTorch(Wire(c.dtype, {2, 2}, 4 * c.size - 1));
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("truncated"));
  }
  EXPECT_FALSE(ToTorch(Wire(v1::FLOAT32, {2}, 12)).ok());  // oversize
}

TEST(TorchCodecTest, ToTorchRejectsUnknownDType) {
  EXPECT_EQ(ToTorch(Wire(static_cast<v1::DType>(99), {1}, 4)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ToTorch(Wire(v1::DTYPE_UNSPECIFIED, {1}, 4)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ToTorch(Wire(v1::FLOAT32, {-1}, 0)).ok());
  EXPECT_FALSE(ToTorch(Wire(v1::FLOAT32, {1, 1, 1, 1, 1, 1, 1, 1, 1}, 4)).ok());
}

TEST(TorchCodecTest, FromTorchRejectsDTypesWithoutEncoding) {
  for (torch::ScalarType type :
       {torch::kComplexFloat, torch::kComplexDouble, torch::kInt16, torch::kInt8}) {
    torch::Tensor t = torch::zeros({2}, torch::TensorOptions().dtype(type));
    auto wire = FromTorch(t);
    EXPECT_EQ(wire.status().code(), absl::StatusCode::kInvalidArgument) << c10::toString(type);
    EXPECT_THAT(std::string(wire.status().message()), HasSubstr("no wire encoding"));
  }
}

TEST(TorchCodecTest, TakeTorchAdoptsTheMessageBytesWithoutCopy) {
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  v1::StageMessage msg;
  *msg.mutable_activation() = MakeFloat32Tensor(values.data(), {2, 3});
  const void* bytes = msg.activation().data().data();
  auto t = TakeTorch(msg.mutable_activation());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->data_ptr(), bytes);  // zero copies on receive
  EXPECT_TRUE(msg.activation().data().empty());
  msg.Clear();  // the tensor owns the bytes now
  EXPECT_TRUE(torch::equal(*t, torch::tensor(values).reshape({2, 3})));
}

TEST(TorchCodecTest, TakeTorchValidatesFirst) {
  v1::Tensor wire = Wire(v1::FLOAT32, {2, 2}, 15);
  auto t = TakeTorch(&wire);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("16"));
  EXPECT_EQ(wire.data().size(), 15u);  // a refused message is left alone
}

TEST(TorchCodecTest, WireDtypeHalvesTheBytesAndRoundTrips) {
  EXPECT_EQ(WireScalarType(""), std::nullopt);
  EXPECT_EQ(WireScalarType("float32"), std::nullopt);
  torch::Tensor x = torch::linspace(-3, 3, 64).reshape({8, 8});
  for (const char* name : {"float16", "bfloat16"}) {
    auto wire = FromTorch(x, WireScalarType(name));
    ASSERT_TRUE(wire.ok()) << wire.status();
    EXPECT_EQ(wire->data().size(), 64u * 2) << name;
    auto back = TakeTorch(&*wire, torch::kFloat32);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::allclose(*back, x, /*rtol=*/1e-2, /*atol=*/1e-2)) << name;
  }
  // Integer payloads (targets) never change type.
  auto ids = FromTorch(torch::arange(4), torch::kFloat16);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->dtype(), v1::INT64);
}

}  // namespace
}  // namespace pipemare
