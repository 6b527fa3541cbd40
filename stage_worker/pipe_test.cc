// The Pipe stream's wire (common/pipe_wire.h, stage_worker/tensor_wire.h) and
// its callback-API streams (common/pipe_stream.h) over a real local gRPC
// server.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "common/buffer_pool.h"
#include "common/pipe_stream.h"
#include "common/pipe_wire.h"
#include "common/rpc.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "stage_worker/tensor_wire.h"

namespace pipemare {
namespace {

std::string Flatten(const grpc::ByteBuffer& buffer) {
  grpc::Slice one;
  EXPECT_TRUE(buffer.DumpToSingleSlice(&one).ok());
  return std::string(reinterpret_cast<const char*>(one.begin()), one.size());
}

// The same bytes cut into slices of `piece` bytes, as gRPC hands a large
// message over (many HTTP/2 frames).
grpc::ByteBuffer Reslice(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i < bytes.size(); i += piece) {
    slices.emplace_back(bytes.substr(i, piece));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

v1::StageMessage Header(const torch::Tensor& t, WireTensor* wire, uint64_t microbatch = 7) {
  auto w = ToWire(t);
  EXPECT_TRUE(w.ok()) << w.status();
  *wire = std::move(*w);
  v1::StageMessage m;
  m.set_microbatch(microbatch);
  m.set_phase(v1::TRAIN);
  *m.mutable_activation() = wire->header;
  return m;
}

TEST(PipeWire, TheBytesAreAStageMessageForTheGeneratedParser) {
  torch::Tensor t = torch::arange(12, torch::kFloat32).reshape({3, 4});
  WireTensor wire;
  const v1::StageMessage header = Header(t, &wire);
  grpc::ByteBuffer buffer = EncodePipeMessage(header, wire.payload);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(buffer.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u) << "header and payload travel as two slices";
  EXPECT_EQ(slices[1].begin(), static_cast<const uint8_t*>(t.data_ptr()))
      << "the payload slice is the tensor's own storage, not a copy";

  v1::StageMessage parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(buffer)));
  EXPECT_EQ(parsed.microbatch(), 7u);
  EXPECT_EQ(parsed.phase(), v1::TRAIN);
  ASSERT_TRUE(parsed.has_activation());
  EXPECT_EQ(parsed.activation().dtype(), v1::FLOAT32);
  EXPECT_EQ(
      std::vector<int64_t>(parsed.activation().shape().begin(), parsed.activation().shape().end()),
      (std::vector<int64_t>{3, 4}));
  ASSERT_EQ(parsed.activation().data().size(), 48u);
  EXPECT_EQ(std::memcmp(parsed.activation().data().data(), t.data_ptr(), 48), 0);

  // And what the generated code serialises (a peer on the sync API, a
  // test's raw RPC) decodes the same.
  PipeMessage decoded;
  grpc::ByteBuffer plain = Reslice(parsed.SerializeAsString(), 1 << 20);
  ASSERT_TRUE(DecodePipeMessage(plain, &decoded).ok());
  EXPECT_EQ(decoded.data_size, 48u);
  EXPECT_TRUE(decoded.message.activation().data().empty());
  EXPECT_TRUE(torch::equal(*FromWire(decoded), t));
}

TEST(PipeWire, EveryDtypeRoundTripsWhetherItArrivesInOneSliceOrMany) {
  torch::manual_seed(3);
  const torch::Tensor base = torch::randn({5, 3, 7});
  for (torch::ScalarType type :
       {torch::kFloat32, torch::kFloat64, torch::kFloat16, torch::kBFloat16, torch::kInt64,
        torch::kInt32, torch::kUInt8, torch::kBool}) {
    SCOPED_TRACE(c10::toString(type));
    torch::Tensor t = type == torch::kBool ? base.gt(0) : (base * 50).to(type);
    WireTensor wire;
    const v1::StageMessage header = Header(t, &wire);
    const std::string bytes = Flatten(EncodePipeMessage(header, wire.payload));
    for (size_t piece : {size_t{1} << 20, size_t{13}}) {
      SCOPED_TRACE(piece);
      grpc::ByteBuffer received = Reslice(bytes, piece);
      PipeMessage m;
      ASSERT_TRUE(DecodePipeMessage(received, &m).ok());
      auto back = FromWire(m);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->scalar_type(), type);
      EXPECT_TRUE(torch::equal(*back, t));
    }
  }
  // A non-contiguous tensor goes as its contiguous copy.
  torch::Tensor transposed = base.transpose(0, 2);
  WireTensor wire;
  const v1::StageMessage header = Header(transposed, &wire);
  grpc::ByteBuffer buffer = EncodePipeMessage(header, wire.payload);
  PipeMessage m;
  grpc::ByteBuffer received = Reslice(Flatten(buffer), 4096);
  ASSERT_TRUE(DecodePipeMessage(received, &m).ok());
  EXPECT_TRUE(torch::equal(*FromWire(m), transposed));
}

TEST(PipeWire, TorchAndWireDtypesMapBothWaysAndTypesWithoutAnEncodingAreRefused) {
  for (torch::ScalarType type :
       {torch::kFloat32, torch::kFloat64, torch::kFloat16, torch::kBFloat16, torch::kInt64,
        torch::kInt32, torch::kUInt8, torch::kBool}) {
    SCOPED_TRACE(c10::toString(type));
    const v1::DType wire = WireDType(type);
    EXPECT_NE(wire, v1::DTYPE_UNSPECIFIED);
    EXPECT_EQ(TorchType(wire), type);
  }
  for (torch::ScalarType type : {torch::kComplexFloat, torch::kInt16, torch::kInt8}) {
    EXPECT_EQ(WireDType(type), v1::DTYPE_UNSPECIFIED);
    auto refused = ToWire(torch::zeros({2}, torch::TensorOptions().dtype(type)));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "no wire encoding"));
  }
  EXPECT_EQ(TorchType(v1::DTYPE_UNSPECIFIED), std::nullopt);
}

TEST(PipeWire, AHalfWireDtypeHalvesTheBytesAndComesBackAsFloat32ButIdsNeverChange) {
  EXPECT_EQ(SendAs(WireDtype::kFloat32), std::nullopt);
  const torch::Tensor x = torch::linspace(-3, 3, 64).reshape({8, 8});
  for (WireDtype dtype : {WireDtype::kFloat16, WireDtype::kBFloat16}) {
    SCOPED_TRACE(WireDtypeName(dtype));
    auto wire = ToWire(x, SendAs(dtype));
    ASSERT_TRUE(wire.ok()) << wire.status();
    EXPECT_EQ(wire->header.dtype(), PeerDType(dtype));
    EXPECT_EQ(wire->payload.size, 64u * 2);
    grpc::ByteBuffer buffer = EncodePipeMessage(
        [&] {
          v1::StageMessage m;
          *m.mutable_activation() = wire->header;
          return m;
        }(),
        wire->payload);
    PipeMessage m;
    ASSERT_TRUE(DecodePipeMessage(buffer, &m).ok());
    auto back = FromWire(m, torch::kFloat32);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::allclose(*back, x, /*rtol=*/1e-2, /*atol=*/1e-2));
  }
  // Integer payloads (targets, token ids) never change type.
  auto ids = ToWire(torch::arange(4), SendAs(WireDtype::kFloat16));
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->header.dtype(), v1::INT64);
}

TEST(PipeWire, AOneSliceAlignedPayloadIsAdoptedNotCopied) {
  torch::Tensor t = torch::randn({64, 16});
  WireTensor wire;
  const v1::StageMessage header = Header(t, &wire);
  const std::string bytes = Flatten(EncodePipeMessage(header, wire.payload));
  // The payload's offset in the message decides its alignment; pad the
  // slice so that it lands on a 16-byte boundary, as gRPC's buffers would.
  const size_t payload_at = bytes.size() - t.nbytes();
  auto* storage = new std::string(payload_at % 16 == 0 ? 0 : 16 - payload_at % 16, '\0');
  const size_t pad = storage->size();
  storage->append(bytes);
  grpc::Slice whole(
      storage->data(), storage->size(), [](void* s) { delete static_cast<std::string*>(s); },
      storage);
  grpc::Slice body = whole.sub(pad, whole.size());
  grpc::ByteBuffer received(&body, 1);
  PipeMessage m;
  ASSERT_TRUE(DecodePipeMessage(received, &m).ok());
  ASSERT_EQ(m.data.size(), 1u);
  auto back = FromWire(m);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->data_ptr(), static_cast<const void*>(m.data[0].begin()));
  EXPECT_TRUE(torch::equal(*back, t));
}

TEST(PipeWire, ALargePayloadIsReceivedIntoARecycledBuffer) {
  // BufferPool::kMinBytes of floats: the smallest payload the pool takes.
  const int64_t n = static_cast<int64_t>(BufferPool::kMinBytes / sizeof(float));
  torch::Tensor t = torch::arange(n, torch::kFloat32);
  WireTensor wire;
  const v1::StageMessage header = Header(t, &wire);
  const std::string bytes = Flatten(EncodePipeMessage(header, wire.payload));
  BufferPool& pool = BufferPool::Receive();
  const BufferPool::Stats before = pool.GetStats();
  const void* first = nullptr;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    grpc::ByteBuffer received = Reslice(bytes, size_t{1} << 20);
    PipeMessage m;
    ASSERT_TRUE(DecodePipeMessage(received, &m).ok());
    auto back = FromWire(m);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(torch::equal(*back, t));
    if (round == 0) first = back->data_ptr();
    // Once the tensor is gone its buffer serves the next receive of the size.
    EXPECT_EQ(back->data_ptr(), first);
  }
  const BufferPool::Stats after = pool.GetStats();
  EXPECT_EQ(after.allocated - before.allocated, 1);
  EXPECT_EQ(after.reused - before.reused, 2);
  // A tensor still alive keeps its buffer: the next receive gets another.
  grpc::ByteBuffer r1 = Reslice(bytes, size_t{1} << 20), r2 = Reslice(bytes, size_t{1} << 20);
  PipeMessage m1, m2;
  ASSERT_TRUE(DecodePipeMessage(r1, &m1).ok());
  ASSERT_TRUE(DecodePipeMessage(r2, &m2).ok());
  auto a = FromWire(m1), b = FromWire(m2);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->data_ptr(), b->data_ptr());
  EXPECT_TRUE(torch::equal(*a, t));
  EXPECT_TRUE(torch::equal(*b, t));
  // Received as another dtype (ReceiveAs), the converted tensor is the
  // stage's; the received buffer goes back to the pool at once.
  const size_t free_before = pool.GetStats().free_buffers;
  auto converted = FromWire(m1, torch::kFloat64);
  ASSERT_TRUE(converted.ok());
  EXPECT_EQ(converted->scalar_type(), torch::kFloat64);
  EXPECT_EQ(pool.GetStats().free_buffers, free_before + 1);
}

TEST(BufferPool, KeepsFreeBuffersWithinItsLimitsAndAllocatesSmallOnesPlainly) {
  BufferPool pool;
  const size_t big = BufferPool::kMinBytes;
  {
    auto small = pool.Take(4096);
    ASSERT_NE(small, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.get()) % BufferPool::kAlignment, 0u);
  }
  EXPECT_EQ(pool.GetStats().free_buffers, 0u);  // small: not kept
  std::vector<std::shared_ptr<uint8_t>> held;
  for (size_t i = 0; i < BufferPool::kMaxFreeBuffers + 3; ++i) held.push_back(pool.Take(big + i));
  for (const auto& b : held) {
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.get()) % BufferPool::kAlignment, 0u);
    b.get()[0] = 1;  // writable
  }
  held.clear();
  BufferPool::Stats s = pool.GetStats();
  EXPECT_EQ(s.free_buffers, BufferPool::kMaxFreeBuffers);
  EXPECT_LE(s.free_bytes, BufferPool::kMaxFreeBytes);
  // The oldest went first: the last sizes are the ones kept.
  const size_t last = big + BufferPool::kMaxFreeBuffers + 2;
  const int64_t reused = s.reused;
  { auto again = pool.Take(last); }
  EXPECT_EQ(pool.GetStats().reused, reused + 1);
  { auto first = pool.Take(big); }  // released as the oldest: allocated anew
  EXPECT_EQ(pool.GetStats().reused, reused + 1);
  // Off: nothing kept, every buffer fresh; on again: kept again.
  pool.SetEnabled(false);
  EXPECT_EQ(pool.GetStats().free_buffers, 0u);
  { auto b = pool.Take(big); }
  EXPECT_EQ(pool.GetStats().free_buffers, 0u);
  pool.SetEnabled(true);
  { auto b = pool.Take(big); }
  EXPECT_EQ(pool.GetStats().free_buffers, 1u);
}

TEST(BufferPool, ConcurrentTakesAndReturnsNeverShareABuffer) {
  BufferPool pool;
  const size_t big = BufferPool::kMinBytes;
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        auto b = pool.Take(big);
        if (b == nullptr) {
          ++bad;
          continue;
        }
        std::memset(b.get(), t, 4096);
        std::this_thread::yield();
        for (int k = 0; k < 4096; ++k) {
          if (b.get()[k] != static_cast<uint8_t>(t)) {
            ++bad;
            break;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_LE(pool.GetStats().free_buffers, 4u);
}

TEST(PipeWire, TheSlicesTensorOutlivesTheSenderAndIsFreedAfterTheSend) {
  std::atomic<bool> freed{false};
  auto* data = new float[256];
  for (int i = 0; i < 256; ++i) data[i] = static_cast<float>(i);
  grpc::ByteBuffer buffer;
  {
    torch::Tensor t = torch::from_blob(
        data, {16, 16},
        [&freed](void* p) {
          delete[] static_cast<float*>(p);
          freed = true;
        },
        torch::kFloat32);
    WireTensor wire;
    const v1::StageMessage header = Header(t, &wire);
    buffer = EncodePipeMessage(header, std::move(wire.payload));
  }  // the sender's tensor and its WireTensor are gone
  EXPECT_FALSE(freed) << "the payload slice still holds the storage";
  v1::StageMessage parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(buffer)));
  EXPECT_EQ(reinterpret_cast<const float*>(parsed.activation().data().data())[255], 255.0f);
  buffer.Clear();  // gRPC done with the message
  EXPECT_TRUE(freed);
}

TEST(PipeWire, MalformedBytesAreRefusedNamingWhatIsWrong) {
  torch::Tensor t = torch::ones({4, 4});
  WireTensor wire;
  const v1::StageMessage header = Header(t, &wire);
  const std::string bytes = Flatten(EncodePipeMessage(header, wire.payload));
  auto decode = [](const std::string& b) {
    grpc::ByteBuffer buffer = Reslice(b, 7);
    PipeMessage m;
    return DecodePipeMessage(buffer, &m);
  };
  absl::Status truncated = decode(bytes.substr(0, bytes.size() - 5));
  EXPECT_TRUE(absl::StrContains(truncated.message(), "truncated")) << truncated;

  v1::StageMessage wrong;
  wrong.mutable_activation()->set_dtype(v1::FLOAT32);
  wrong.mutable_activation()->add_shape(3);
  wrong.mutable_activation()->set_data(std::string(8, 'x'));
  absl::Status mismatch = decode(wrong.SerializeAsString());
  EXPECT_TRUE(
      absl::StrContains(mismatch.message(), "tensor.data: 8 bytes but shape and dtype need 12"))
      << mismatch;

  absl::Status garbage = decode(std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 11));
  EXPECT_EQ(garbage.code(), absl::StatusCode::kInvalidArgument) << garbage;
  EXPECT_TRUE(absl::StrContains(garbage.message(), "Pipe message")) << garbage;

  v1::StageMessage two;
  two.mutable_activation()->set_dtype(v1::FLOAT32);
  std::string both = two.SerializeAsString();
  v1::StageMessage other;
  other.mutable_gradient()->set_dtype(v1::FLOAT32);
  both += other.SerializeAsString();
  absl::Status st = decode(both);
  EXPECT_TRUE(absl::StrContains(st.message(), "more than one")) << st;
}

// A Pipe server in this process whose acceptor hands every stream to the
// test.
class PipeServer final
    : public v1::StageWorker::WithRawCallbackMethod_Pipe<v1::StageWorker::Service> {
 public:
  std::function<grpc::Status(absl::StatusOr<PipeMessage>, std::shared_ptr<PipeStream>)> accept;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Pipe(
      grpc::CallbackServerContext* context) override {
    return ServePipe(context, accept);
  }
};

grpc::ByteBuffer Small(uint64_t microbatch, size_t bytes) {
  auto data = std::make_shared<std::vector<uint8_t>>(bytes, static_cast<uint8_t>(microbatch));
  v1::StageMessage m;
  m.set_microbatch(microbatch);
  m.mutable_activation()->set_dtype(v1::UINT8);
  m.mutable_activation()->add_shape(static_cast<int64_t>(bytes));
  return EncodePipeMessage(m, {data->data(), data->size(), data});
}

TEST(PipeStream, AFullReceiverPausesTheSenderAndResumingDeliversEverythingInOrder) {
  PipeServer service;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> got;
  std::shared_ptr<PipeStream> server_end;
  bool paused = false;
  service.accept = [&](absl::StatusOr<PipeMessage> first, std::shared_ptr<PipeStream> s) {
    if (!first.ok() || !first->message.has_open()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "open first");
    }
    PipeStream::Callbacks cb;
    cb.on_message = [&](absl::StatusOr<PipeMessage> m) {
      EXPECT_TRUE(m.ok());
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(m->message.microbatch());
      cv.notify_all();
      // The receiver holds 4, then stops reading until the test resumes.
      if (got.size() == 4) paused = true;
      return got.size() != 4;
    };
    s->SetCallbacks(std::move(cb), 2);
    std::lock_guard<std::mutex> lock(mu);
    server_end = std::move(s);
    return grpc::Status::OK;
  };
  int port = 0;
  auto server = StartServer("127.0.0.1:0", &service, &port, "--listen");
  ASSERT_TRUE(server.ok()) << server.status();

  std::atomic<bool> ended{false};
  PipeStream::Callbacks cb;
  cb.on_message = [](absl::StatusOr<PipeMessage>) { return true; };
  cb.on_end = [&](const grpc::Status&) { ended = true; };
  v1::StageMessage open;
  open.mutable_open()->set_job_id("j");
  auto client = OpenPipe(MakeChannel(absl::StrCat("127.0.0.1:", port)), EncodePipeMessage(open),
                         std::move(cb), /*capacity=*/2);
  // 1 MiB messages: with the receiver paused, HTTP/2's windows fill and the
  // sender's queue with them; Send then waits.
  constexpr int kMessages = 40;
  std::atomic<int> sent{0};
  std::thread sender([&] {
    for (int i = 1; i <= kMessages; ++i) {
      if (!client->Send(Small(i, 1 << 20))) return;
      ++sent;
    }
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return paused; }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LT(sent.load(), kMessages) << "the sender must wait while the receiver is paused";
  EXPECT_EQ(client->high_water(), 2u);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(got.size(), 4u);
  }
  server_end->ResumeReading();
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20),
                            [&] { return got.size() == static_cast<size_t>(kMessages); }));
    for (int i = 0; i < kMessages; ++i) EXPECT_EQ(got[i], static_cast<uint64_t>(i + 1));
  }
  sender.join();
  EXPECT_GT(client->blocked_seconds(), 0.2);
  client->CloseAndWait();
  EXPECT_TRUE(ended);
  EXPECT_FALSE(client->Send(Small(99, 8))) << "a closed stream takes nothing";
  (*server)->Shutdown();
}

TEST(PipeStream, ARefusedOpenReachesTheClientWithTheServersStatus) {
  PipeServer service;
  service.accept = [](absl::StatusOr<PipeMessage>, std::shared_ptr<PipeStream>) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "open.generation: refused");
  };
  int port = 0;
  auto server = StartServer("127.0.0.1:0", &service, &port, "--listen");
  ASSERT_TRUE(server.ok());
  std::mutex mu;
  std::condition_variable cv;
  std::optional<grpc::Status> end;
  PipeStream::Callbacks cb;
  cb.on_end = [&](const grpc::Status& st) {
    std::lock_guard<std::mutex> lock(mu);
    end = st;
    cv.notify_all();
  };
  auto client =
      OpenPipe(MakeChannel(absl::StrCat("127.0.0.1:", port)), Small(1, 4), std::move(cb), 2);
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return end.has_value(); }));
  EXPECT_EQ(end->error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(end->error_message(), "open.generation: refused");
  lock.unlock();
  (*server)->Shutdown();
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

TEST(PipeStream, ABadMessageEndsTheStreamWithTheReceiversStatusForASyncClient) {
  PipeServer service;
  std::shared_ptr<PipeStream> server_end;
  std::mutex mu;
  service.accept = [&](absl::StatusOr<PipeMessage>, std::shared_ptr<PipeStream> s) {
    PipeStream::Callbacks cb;
    PipeStream* raw = s.get();
    cb.on_message = [raw](absl::StatusOr<PipeMessage> m) {
      if (m.ok()) return true;
      // (Nothing more is written to it: gRPC gives a client the status only
      // after it read every message.)
      raw->CloseWith(
          grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(m.status().message())),
          false);
      return false;
    };
    s->SetCallbacks(std::move(cb), 2);
    std::lock_guard<std::mutex> lock(mu);
    server_end = std::move(s);
    return grpc::Status::OK;
  };
  int port = 0;
  auto server = StartServer("127.0.0.1:0", &service, &port, "--listen");
  ASSERT_TRUE(server.ok());
  auto stub = v1::StageWorker::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub->Pipe(&ctx);
  v1::StageMessage open;
  open.mutable_open()->set_job_id("j");
  ASSERT_TRUE(stream->Write(open));
  v1::StageMessage bad;
  bad.mutable_activation()->set_dtype(v1::FLOAT32);
  bad.mutable_activation()->add_shape(8);
  bad.mutable_activation()->set_data(std::string(7, '\0'));
  stream->Write(bad);
  stream->WritesDone();
  grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "truncated")) << st.error_message();
  (*server)->Shutdown();
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

TEST(PipeStream, APausedReceiverLearnsThatItsSenderWentAway) {
  // The receiver stopped reading (its queue is full), so no read is in
  // flight to fail: the stream still ends when the sender's call does, and
  // the stage hears it at once rather than when it next resumes reading.
  PipeServer service;
  std::mutex mu;
  std::condition_variable cv;
  bool paused = false;
  std::optional<grpc::Status> end;
  std::shared_ptr<PipeStream> server_end;
  service.accept = [&](absl::StatusOr<PipeMessage>, std::shared_ptr<PipeStream> s) {
    PipeStream::Callbacks cb;
    cb.on_message = [&](absl::StatusOr<PipeMessage>) {
      std::lock_guard<std::mutex> lock(mu);
      paused = true;
      cv.notify_all();
      return false;
    };
    cb.on_end = [&](const grpc::Status& st) {
      std::lock_guard<std::mutex> lock(mu);
      end = st;
      cv.notify_all();
    };
    s->SetCallbacks(std::move(cb), 2);
    std::lock_guard<std::mutex> lock(mu);
    server_end = std::move(s);
    return grpc::Status::OK;
  };
  int port = 0;
  auto server = StartServer("127.0.0.1:0", &service, &port, "--listen");
  ASSERT_TRUE(server.ok());
  v1::StageMessage open;
  open.mutable_open()->set_job_id("j");
  auto client = OpenPipe(MakeChannel(absl::StrCat("127.0.0.1:", port)), EncodePipeMessage(open),
                         PipeStream::Callbacks{}, 2);
  ASSERT_TRUE(client->Send(Small(1, 64)));
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return paused; }));
  lock.unlock();
  client->CloseAndWait();  // cancels the call, as a dying process's RST does
  lock.lock();
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return end.has_value(); }))
      << "the paused stream never ended";
  EXPECT_EQ(end->error_code(), grpc::StatusCode::CANCELLED);
  lock.unlock();
  (*server)->Shutdown();
}

}  // namespace
}  // namespace pipemare
