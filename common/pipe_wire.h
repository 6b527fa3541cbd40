// The Pipe stream's messages as gRPC byte buffers, with tensor payloads that
// are never copied by us on send and copied at most once on receive.
//
// On the wire a message is ordinary `pipemare.v1.StageMessage` protobuf (any
// protobuf parser reads it; tests check that with the generated code), laid
// out as two slices:
//   1. the header: the message serialised with its tensor's `data` empty
//      (microbatch, phase, and the tensor field with dtype and shape), then
//      the tensor field once more holding only the tag and length of `data`;
//      protobuf merges the two occurrences of the field into one tensor;
//   2. the payload: a slice over the sender's own memory (a tensor's
//      storage), which the slice keeps alive until gRPC has sent it.
// Receiving walks gRPC's slices: everything but the tensor's data is parsed
// by protobuf; the data stays in gRPC's slices (PipeMessage::data) until the
// consumer copies it once into its tensor, or adopts it when it arrived as
// one slice.
//
// The tensor layout's rules are here too (ValidateTensorLayout): dtype, at
// most 8 dimensions, raw little-endian bytes, row-major, exactly as many bytes
// as dtype and shape say. This is the one module that knows the wire; no
// LibTorch here, the coordinator's feeds use it too. The torch side (tensors
// in and out, dtypes) is stage_worker/tensor_wire.h.
#ifndef PIPEMARE_COMMON_PIPE_WIRE_H_
#define PIPEMARE_COMMON_PIPE_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// Bytes per element of `dtype`; 0 for DTYPE_UNSPECIFIED or unknown values.
int ElementSize(v1::DType dtype);

// Number of elements of `shape`, or INVALID_ARGUMENT for a negative dimension
// or an overflow.
absl::StatusOr<int64_t> ElementCount(const google::protobuf::RepeatedField<int64_t>& shape);

// OK iff the dtype is known, no dimension is negative, there are at most 8
// dimensions, and `data_bytes` (the tensor's data, which may travel apart from
// it) == elements * ElementSize(dtype). The message says which of these broke,
// with the numbers.
absl::Status ValidateTensorLayout(const v1::Tensor& tensor, int64_t data_bytes);

// Bytes the wire borrows: `data` stays valid while `owner` lives.
struct WirePayload {
  const void* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> owner;
};

// The tensor field `message` carries (activation, gradient or targets), or
// null when it carries none.
const v1::Tensor* PayloadTensor(const v1::StageMessage& message);
v1::Tensor* MutablePayloadTensor(v1::StageMessage* message);

// Encodes `message`. When it carries a tensor, that tensor's `data` must be
// empty and `payload` holds it: sent as its own slice, not copied.
grpc::ByteBuffer EncodePipeMessage(const v1::StageMessage& message, WirePayload payload = {});

// A received message. `message` is complete except for its tensor's data,
// which is `data`: slices of gRPC's receive buffers, `data_size` bytes in all.
// Decoding validated the tensor's dtype and shape against data_size, or,
// when the tensor's data_plane_bytes is set (its data comes over the data
// plane, schedule.transport "gloo"), against that, with no data here.
struct PipeMessage {
  v1::StageMessage message;
  std::vector<grpc::Slice> data;
  size_t data_size = 0;

  // Copies the payload to `out` (data_size bytes).
  void CopyData(void* out) const;
};

// Parses `buffer`. INVALID_ARGUMENT naming what is malformed (not protobuf, a
// truncated field, a tensor whose data does not match its dtype and shape).
absl::Status DecodePipeMessage(grpc::ByteBuffer& buffer, PipeMessage* out);

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_PIPE_WIRE_H_
