// The wire's tensor layout checks (common/pipe_wire.h), without LibTorch so
// that the sanitizer builds run them; the message framing and the torch side
// are in stage_worker/pipe_test.cc, the decoder under the fuzzer too
// (fuzz/pipe_message_fuzzer.cc).
#include "common/pipe_wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace pipemare {
namespace {

using ::testing::HasSubstr;

struct DTypeCase {
  v1::DType dtype;
  int size;
};

const DTypeCase kDTypes[] = {
    {v1::FLOAT32, 4}, {v1::FLOAT64, 8}, {v1::FLOAT16, 2}, {v1::BFLOAT16, 2},
    {v1::INT64, 8},   {v1::INT32, 4},   {v1::UINT8, 1},   {v1::BOOL, 1},
};

v1::Tensor Header(v1::DType dtype, const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

std::string Check(v1::DType dtype, const std::vector<int64_t>& shape, int64_t bytes) {
  return std::string(ValidateTensorLayout(Header(dtype, shape), bytes).message());
}

TEST(WireLayout, ElementSizeOfEveryDType) {
  for (const auto& c : kDTypes) {
    EXPECT_EQ(ElementSize(c.dtype), c.size) << v1::DType_Name(c.dtype);
  }
  EXPECT_EQ(ElementSize(v1::DTYPE_UNSPECIFIED), 0);
  EXPECT_EQ(ElementSize(static_cast<v1::DType>(99)), 0);
}

TEST(WireLayout, ElementCountIsTheProductAndRefusesNegativesAndOverflow) {
  v1::Tensor t;
  EXPECT_EQ(*ElementCount(t.shape()), 1);  // a scalar
  t = Header(v1::FLOAT32, {2, 3, 4});
  EXPECT_EQ(*ElementCount(t.shape()), 24);
  t.add_shape(0);
  EXPECT_EQ(*ElementCount(t.shape()), 0);
  t.add_shape(-1);
  EXPECT_EQ(ElementCount(t.shape()).status().code(), absl::StatusCode::kInvalidArgument);
  t = Header(v1::FLOAT32, {std::numeric_limits<int64_t>::max() / 2, 4});
  EXPECT_THAT(std::string(ElementCount(t.shape()).status().message()), HasSubstr("overflow"));
}

TEST(WireLayout, AcceptsTheExactByteCountForEveryDType) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    EXPECT_TRUE(ValidateTensorLayout(Header(c.dtype, {2, 3}), 6 * c.size).ok());
    EXPECT_TRUE(ValidateTensorLayout(Header(c.dtype, {}), c.size).ok());  // scalar
    EXPECT_TRUE(ValidateTensorLayout(Header(c.dtype, {0, 5}), 0).ok());   // empty
    EXPECT_TRUE(ValidateTensorLayout(Header(c.dtype, {1, 1, 1, 1, 1, 1, 1, 2}), 2 * c.size).ok());
  }
}

TEST(WireLayout, RefusesTruncatedAndOversizePayloadsWithTheNumbers) {
  for (const auto& c : kDTypes) {
    SCOPED_TRACE(v1::DType_Name(c.dtype));
    const std::string truncated = Check(c.dtype, {2, 3}, 6 * c.size - 1);
    EXPECT_THAT(truncated, HasSubstr("truncated"));
    EXPECT_THAT(truncated, HasSubstr(std::to_string(6 * c.size)));
    EXPECT_THAT(Check(c.dtype, {2, 3}, 6 * c.size + 1), HasSubstr("mismatch"));
  }
  EXPECT_THAT(Check(v1::FLOAT32, {4}, 0), HasSubstr("truncated"));
  EXPECT_THAT(Check(v1::UINT8, {0}, 1), HasSubstr("mismatch"));
}

TEST(WireLayout, RefusesUnknownDTypesNamingTheAllowedOnes) {
  EXPECT_THAT(Check(static_cast<v1::DType>(99), {1}, 4), HasSubstr("99"));
  EXPECT_THAT(Check(static_cast<v1::DType>(99), {1}, 4), HasSubstr("FLOAT32"));
  EXPECT_THAT(Check(v1::DTYPE_UNSPECIFIED, {1}, 4), HasSubstr("dtype"));
}

TEST(WireLayout, RefusesNegativeDimensionsTooManyDimensionsAndByteOverflow) {
  EXPECT_THAT(Check(v1::FLOAT32, {2, -1}, 0), HasSubstr("negative"));
  // Two negatives multiply to a positive count: still refused.
  EXPECT_THAT(Check(v1::FLOAT32, {-2, -2}, 16), HasSubstr("negative"));
  EXPECT_THAT(Check(v1::FLOAT32, {1, 1, 1, 1, 1, 1, 1, 1, 1}, 4), HasSubstr("at most 8"));
  EXPECT_THAT(Check(v1::FLOAT64, {std::numeric_limits<int64_t>::max() / 4}, 8),
              HasSubstr("overflow"));
}

}  // namespace
}  // namespace pipemare
