// torch::Tensor <-> the Pipe stream's zero-copy wire (common/pipe_wire.h, the
// format and its checks): the one place tensors and dtypes cross to the wire.
//
// Copies of a payload between two stages, per hop:
//   send:    0 of ours: the payload slice points at the tensor's own storage
//            and holds a reference to it until gRPC has written it (a
//            tensor that is not contiguous on the CPU, or a wire dtype
//            conversion, makes one contiguous copy first); the kernel copies
//            it into the socket;
//   receive: the kernel copies it into gRPC's read buffers; then 1 copy into
//            the tensor, or 0 when the payload arrived in one slice aligned
//            for its dtype (the tensor then adopts gRPC's buffer). A payload
//            of BufferPool::kMinBytes or more is copied into a recycled
//            buffer (common/buffer_pool.h), not a freshly mapped one.
#ifndef PIPEMARE_STAGE_WORKER_TENSOR_WIRE_H_
#define PIPEMARE_STAGE_WORKER_TENSOR_WIRE_H_

#include <torch/torch.h>

#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/pipe_wire.h"
#include "pipeline/core/settings.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// The torch scalar type of a wire dtype, or nullopt for one it lacks.
std::optional<torch::ScalarType> TorchType(v1::DType dtype);
// The wire dtype of a torch scalar type, or DTYPE_UNSPECIFIED.
v1::DType WireDType(torch::ScalarType type);
// What a floating tensor is converted to before it travels to a neighbour
// under `dtype` (schedule.wire_dtype, PeerDType); nullopt for float32.
std::optional<torch::ScalarType> SendAs(WireDtype dtype);

// `tensor` on the wire: its dtype and shape (data empty) and its bytes.
struct WireTensor {
  v1::Tensor header;
  WirePayload payload;
};

// With `as` (a floating type), a floating tensor is converted to it first.
// INVALID_ARGUMENT for a dtype the wire format lacks.
absl::StatusOr<WireTensor> ToWire(const torch::Tensor& tensor,
                                  std::optional<torch::ScalarType> as = std::nullopt);

// An uninitialised CPU tensor to receive a payload into: from the receive
// BufferPool when it is that large, else torch::empty. RESOURCE_EXHAUSTED
// when the memory is not there.
absl::StatusOr<torch::Tensor> EmptyForReceive(const std::vector<int64_t>& shape,
                                              torch::ScalarType type);

// The tensor `message` carries (DecodePipeMessage validated it), on the CPU;
// with `as` (a floating type), a floating payload is converted to it.
// INVALID_ARGUMENT when the message carries no tensor.
absl::StatusOr<torch::Tensor> FromWire(const PipeMessage& message,
                                       std::optional<torch::ScalarType> as = std::nullopt);

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_TENSOR_WIRE_H_
