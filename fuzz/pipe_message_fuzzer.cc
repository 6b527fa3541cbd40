// Fuzzes the Pipe stream's decoder (common/pipe_wire.h) as gRPC hands it
// bytes: the input (after its first byte) is cut into up to four slices at
// points the first byte picks, so that a field or the payload may straddle
// slices as it does off the network. A message that decodes has its payload
// copied out, as a stage would.
#include <grpc/grpc.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/pipe_wire.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  grpc_init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t cuts = data[0];
  ++data;
  --size;
  std::vector<grpc::Slice> slices;
  size_t start = 0;
  for (int k = 0; k < 3; ++k) {
    const size_t at = size == 0 ? 0 : (static_cast<size_t>((cuts >> (2 * k)) & 3) * size) / 4;
    if (at > start) {
      slices.emplace_back(data + start, at - start);
      start = at;
    }
  }
  slices.emplace_back(data + start, size - start);
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  pipemare::PipeMessage message;
  if (!pipemare::DecodePipeMessage(buffer, &message).ok()) return 0;
  if (message.data_size > size) __builtin_trap();  // the payload comes from the input
  std::vector<uint8_t> out(message.data_size);
  message.CopyData(out.data());
  return 0;
}
