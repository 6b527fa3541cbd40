#include "common/pipe_wire.h"

#include <cstring>
#include <limits>
#include <string>
#include <utility>

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

// Protobuf wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLen = 2, kFixed32 = 5;
// Tensor.data's field number.
constexpr int kTensorData = 3;

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void PutTag(int field, int wire_type, std::string* out) {
  PutVarint((static_cast<uint64_t>(field) << 3) | wire_type, out);
}
size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

int PayloadField(const v1::StageMessage& m) {
  switch (m.payload_case()) {
    case v1::StageMessage::kActivation:
      return v1::StageMessage::kActivationFieldNumber;
    case v1::StageMessage::kGradient:
      return v1::StageMessage::kGradientFieldNumber;
    case v1::StageMessage::kTargets:
      return v1::StageMessage::kTargetsFieldNumber;
    default:
      return 0;
  }
}

// Reads gRPC's slices as one byte stream without copying them.
class SliceReader {
 public:
  explicit SliceReader(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) {
    for (const auto& s : slices_) size_ += s.size();
  }
  size_t position() const { return position_; }
  size_t size() const { return size_; }

  bool Byte(uint8_t* b) {
    if (!Settle()) return false;
    *b = slices_[index_].begin()[offset_++];
    ++position_;
    return true;
  }
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // longer than 10 bytes
  }
  // Appends the next `n` bytes to `out` (copies: only for small fields).
  bool Append(size_t n, std::string* out) {
    if (n > size_ - position_) return false;
    while (n > 0) {
      Settle();
      const size_t k = std::min(n, slices_[index_].size() - offset_);
      out->append(reinterpret_cast<const char*>(slices_[index_].begin() + offset_), k);
      Advance(k);
      n -= k;
    }
    return true;
  }
  // The next `n` bytes as sub-slices of gRPC's (no copy).
  bool Take(size_t n, std::vector<grpc::Slice>* out) {
    if (n > size_ - position_) return false;
    while (n > 0) {
      Settle();
      const size_t k = std::min(n, slices_[index_].size() - offset_);
      out->push_back(slices_[index_].sub(offset_, offset_ + k));
      Advance(k);
      n -= k;
    }
    return true;
  }
  bool Skip(size_t n) {
    if (n > size_ - position_) return false;
    while (n > 0) {
      Settle();
      const size_t k = std::min(n, slices_[index_].size() - offset_);
      Advance(k);
      n -= k;
    }
    return true;
  }

 private:
  // Moves past exhausted slices; false at the end of the stream.
  bool Settle() {
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
    return index_ < slices_.size();
  }
  void Advance(size_t k) {
    offset_ += k;
    position_ += k;
  }

  std::vector<grpc::Slice> slices_;
  size_t size_ = 0, index_ = 0, offset_ = 0, position_ = 0;
};

// Reads one field's value of `wire_type` (after its tag) and appends the
// field, tag included, to `out` (null: skip it).
bool CopyField(SliceReader& in, uint64_t tag, std::string* out) {
  std::string scratch;
  std::string* dst = out != nullptr ? out : &scratch;
  switch (tag & 7) {
    case kVarint: {
      uint64_t v;
      if (!in.Varint(&v)) return false;
      PutVarint(tag, dst);
      PutVarint(v, dst);
      return true;
    }
    case kFixed64:
      PutVarint(tag, dst);
      return in.Append(8, dst);
    case kFixed32:
      PutVarint(tag, dst);
      return in.Append(4, dst);
    case kLen: {
      uint64_t n;
      if (!in.Varint(&n)) return false;
      if (out == nullptr) return in.Skip(n);
      PutVarint(tag, dst);
      PutVarint(n, dst);
      return in.Append(n, dst);
    }
    default:  // groups (3, 4) are not used by StageMessage
      return false;
  }
}

absl::Status Malformed(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("Pipe message: ", what));
}

}  // namespace

const v1::Tensor* PayloadTensor(const v1::StageMessage& m) {
  switch (m.payload_case()) {
    case v1::StageMessage::kActivation:
      return &m.activation();
    case v1::StageMessage::kGradient:
      return &m.gradient();
    case v1::StageMessage::kTargets:
      return &m.targets();
    default:
      return nullptr;
  }
}

v1::Tensor* MutablePayloadTensor(v1::StageMessage* m) {
  switch (m->payload_case()) {
    case v1::StageMessage::kActivation:
      return m->mutable_activation();
    case v1::StageMessage::kGradient:
      return m->mutable_gradient();
    case v1::StageMessage::kTargets:
      return m->mutable_targets();
    default:
      return nullptr;
  }
}

grpc::ByteBuffer EncodePipeMessage(const v1::StageMessage& message, WirePayload payload) {
  std::string header = message.SerializeAsString();
  const int field = PayloadField(message);
  if (field == 0 || payload.size == 0) {
    grpc::Slice slice(header);
    return grpc::ByteBuffer(&slice, 1);
  }
  // The tensor field again, holding only `data`'s tag and length; the bytes
  // follow in the payload slice.
  const size_t data_field = 1 + VarintSize(payload.size) + payload.size;
  PutTag(field, kLen, &header);
  PutVarint(data_field, &header);
  PutTag(kTensorData, kLen, &header);
  PutVarint(payload.size, &header);
  auto* owner = new std::shared_ptr<const void>(std::move(payload.owner));
  grpc::Slice slices[2] = {
      grpc::Slice(header),
      grpc::Slice(
          const_cast<void*>(payload.data), payload.size,
          [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, owner)};
  return grpc::ByteBuffer(slices, 2);
}

void PipeMessage::CopyData(void* out) const {
  char* dst = static_cast<char*>(out);
  for (const grpc::Slice& s : data) {
    std::memcpy(dst, s.begin(), s.size());
    dst += s.size();
  }
}

absl::Status DecodePipeMessage(grpc::ByteBuffer& buffer, PipeMessage* out) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return Malformed("unreadable buffer");
  SliceReader in(std::move(slices));
  std::string rest;  // every field but the tensor's, for protobuf to parse
  int tensor_field = 0;
  v1::Tensor tensor;  // dtype and shape; the data stays in slices
  out->data.clear();
  out->data_size = 0;
  while (in.position() < in.size()) {
    uint64_t tag;
    if (!in.Varint(&tag)) return Malformed("truncated field tag");
    const uint64_t field = tag >> 3;
    const bool tensor_payload =
        (tag & 7) == kLen && (field == v1::StageMessage::kActivationFieldNumber ||
                              field == v1::StageMessage::kGradientFieldNumber ||
                              field == v1::StageMessage::kTargetsFieldNumber);
    if (!tensor_payload) {
      if (!CopyField(in, tag, &rest))
        return Malformed(absl::StrCat("field ", field, " is truncated"));
      continue;
    }
    if (tensor_field != 0 && tensor_field != static_cast<int>(field)) {
      return Malformed("payload: carries more than one tensor field");
    }
    tensor_field = static_cast<int>(field);
    uint64_t length;
    if (!in.Varint(&length) || length > in.size() - in.position()) {
      return Malformed(absl::StrCat("field ", field, " (tensor) is truncated"));
    }
    const size_t end = in.position() + length;
    std::string small;  // the tensor's fields but data (dtype, shape)
    while (in.position() < end) {
      uint64_t t;
      if (!in.Varint(&t)) return Malformed("tensor: truncated field tag");
      if ((t >> 3) == kTensorData && (t & 7) == kLen) {
        uint64_t n;
        if (!in.Varint(&n) || n > end - in.position()) return Malformed("tensor.data is truncated");
        out->data.clear();  // protobuf: the last occurrence wins
        if (!in.Take(n, &out->data)) return Malformed("tensor.data is truncated");
        out->data_size = n;
        continue;
      }
      if (!CopyField(in, t, &small)) return Malformed("tensor: a field is truncated");
    }
    if (in.position() != end) return Malformed("tensor: a field overruns the tensor");
    if (!tensor.MergeFromString(small)) return Malformed("tensor: not a pipemare.v1.Tensor");
  }
  out->message.Clear();
  if (!out->message.ParseFromString(rest)) {
    return Malformed("not a pipemare.v1.StageMessage");
  }
  if (tensor_field != 0) {
    if (out->message.payload_case() != v1::StageMessage::PAYLOAD_NOT_SET) {
      return Malformed("payload: carries more than one payload field");
    }
    v1::Tensor* t =
        tensor_field == v1::StageMessage::kActivationFieldNumber ? out->message.mutable_activation()
        : tensor_field == v1::StageMessage::kGradientFieldNumber ? out->message.mutable_gradient()
                                                                 : out->message.mutable_targets();
    *t = std::move(tensor);
    int64_t bytes = static_cast<int64_t>(out->data_size);
    if (t->data_plane_bytes() != 0) {
      // Its data comes over the edge's data plane (schedule.transport).
      if (t->data_plane_bytes() < 0 || out->data_size != 0) {
        return Malformed(absl::StrCat("tensor.data_plane_bytes: ", t->data_plane_bytes(), " with ",
                                      out->data_size,
                                      " bytes of data in the message; either positive with no "
                                      "data, or 0"));
      }
      bytes = t->data_plane_bytes();
    }
    if (auto st = ValidateTensorLayout(*t, bytes); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace pipemare
