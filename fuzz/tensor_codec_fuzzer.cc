// Fuzzes the tensor codec (pipeline/tensor_codec.h): any bytes that parse as
// a Tensor message are validated, and a valid one is decoded.
#include <cstddef>
#include <cstdint>

#include "pipeline/tensor_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pipemare::v1::Tensor tensor;
  if (!tensor.ParseFromArray(data, static_cast<int>(size))) return 0;
  (void)pipemare::ElementCount(tensor.shape());
  if (!pipemare::ValidateTensor(tensor).ok()) return 0;
  if (tensor.dtype() == pipemare::v1::FLOAT32) (void)pipemare::Float32Values(tensor);
  if (tensor.dtype() == pipemare::v1::INT64) (void)pipemare::Int64Values(tensor);
  return 0;
}
