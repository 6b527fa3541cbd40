// bench_transport: how fast is our stage-to-stage transport compared with
// gRPC itself and a plain TCP socket, for activation-sized messages over
// loopback (127.0.0.1)? Four paths, all in this one process:
//   Pipe       the default (schedule.transport grpc): a `StageWorker.Pipe`
//              stream through common/pipe_stream.h and pipe_wire.h, exactly
//              as between two stages;
//   Pipe+gloo  schedule.transport gloo: the header on that stream, the bytes
//              over a stage_worker/gloo_edge.h pair, received by a consumer
//              thread as a stage's compute thread receives them;
//   bare gRPC  the same bytes as raw ByteBuffers on gRPC's callback API with
//              no Pipemare code: gRPC's own share of the gap to TCP;
//   TCP        length-prefixed frames on a socket, the fewest copies a
//              socket allows (kernel copies only).
// For each payload size (--sizes) and each path, two measurements:
//
//  * throughput: the client sends messages back to back for --seconds (or
//    --messages), then an end marker; the server counts what it received and
//    acknowledges the marker with the count. GiB/s = payload bytes the server
//    received / time from the first send to the acknowledgement.
//  * latency: ping-pong; the client sends one payload message, the server
//    answers each with a tiny ack, the client waits for it before sending the
//    next. Reported: the median round trip (full payload one way, the small
//    ack back) in microseconds, over all pings.
//
// Each measurement is repeated --rounds times, the paths interleaved, so a
// noisy neighbour on a shared machine hits them alike. Throughput is the
// best round; latency the median over the pings of all rounds. Before each
// timed burst an untimed warm-up burst lets HTTP/2 flow control (BDP probing)
// and TCP autotuning settle. Every receiver checks each payload's first and
// last float. Copies per hop are listed in docs/architecture.md.
//
//   bench_transport [--sizes 64K,256K,1M,4M,16M,64M] [--seconds 1]
//                   [--messages N] [--rounds 2] [--output table|json]
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/buffer_pool.h"
#include "common/pipe_stream.h"
#include "common/pipe_wire.h"
#include "common/rpc.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "stage_worker/gloo_edge.h"

namespace pipemare::bench {
namespace {

namespace v1 = ::pipemare::v1;
using Clock = std::chrono::steady_clock;

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * kKiB;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Room left in kMaxMessageBytes for the proto's own fields.
constexpr int64_t kMaxPayloadBytes = kMaxMessageBytes - kMiB;
// Each warm-up burst sends at least this many bytes (and at least 2 messages).
constexpr int64_t kWarmupBytes = 16 * kMiB;

// How long one measurement runs: until `seconds` have passed or `messages`
// were sent, whichever comes first (0 turns a bound off). Always >= 1 message.
struct Bounds {
  double seconds = 1.0;
  int64_t messages = 0;

  bool Done(int64_t sent, Clock::time_point start) const {
    if (sent < 1) return false;
    if (messages > 0 && sent >= messages) return true;
    return seconds > 0 && std::chrono::duration<double>(Clock::now() - start).count() >= seconds;
  }
};

// --max-frame-size: HTTP/2's largest frame both gRPC paths advertise (0:
// gRPC's default, 16 KiB). Issue 14 item 2's experiment.
int g_max_frame_size = 0;

std::shared_ptr<grpc::Channel> BenchChannel(int port) {
  grpc::ChannelArguments args = ChannelArgs();
  if (g_max_frame_size > 0) args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, g_max_frame_size);
  return grpc::CreateCustomChannel(WithPort("127.0.0.1:0", port),
                                   grpc::InsecureChannelCredentials(), args);
}

// A loopback server with Pipemare's limits and keepalives (and
// --max-frame-size), the services `add` registers, and a connected channel
// to it.
struct BenchServer {
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<grpc::Channel> channel;
};
absl::StatusOr<BenchServer> StartBenchServer(const std::function<void(grpc::ServerBuilder&)>& add) {
  grpc::ServerBuilder builder;
  int port = 0;
  ListenExclusively(builder, "127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  ApplyServerOptions(builder);
  if (g_max_frame_size > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, g_max_frame_size);
  }
  add(builder);
  BenchServer out;
  out.server = builder.BuildAndStart();
  if (!out.server || port == 0) return absl::UnavailableError("cannot start a loopback server");
  out.channel = BenchChannel(port);
  if (!out.channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to 127.0.0.1:", port));
  }
  return out;
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

std::string SizeName(int64_t bytes) {
  if (bytes % kMiB == 0) return absl::StrCat(bytes / kMiB, " MiB");
  if (bytes % kKiB == 0) return absl::StrCat(bytes / kKiB, " KiB");
  return absl::StrCat(bytes, " B");
}

// The client's preallocated activation: float i holds i, so the receiver can
// check the first and last element without a copy of its own.
class Payload {
 public:
  explicit Payload(int64_t bytes) : floats_(bytes / sizeof(float)) {
    for (size_t i = 0; i < floats_.size(); ++i) floats_[i] = static_cast<float>(i);
  }
  const char* data() const { return reinterpret_cast<const char*>(floats_.data()); }
  int64_t floats() const { return static_cast<int64_t>(floats_.size()); }
  int64_t bytes() const { return floats() * static_cast<int64_t>(sizeof(float)); }

 private:
  std::vector<float> floats_;
};

// The receiver's "touch": the first and last float must be what Payload wrote.
bool TouchOk(const char* data, int64_t floats) {
  if (floats == 0) return true;
  float first, last;
  std::memcpy(&first, data, sizeof(float));
  std::memcpy(&last, data + (floats - 1) * sizeof(float), sizeof(float));
  return first == 0.0f && last == static_cast<float>(floats - 1);
}

struct Throughput {
  int64_t bytes = 0;
  double seconds = 0;
  double gib_per_s() const { return seconds > 0 ? bytes / kGiB / seconds : 0; }
};

// ---------------------------------------------------------------------------
// Our Pipe: StageWorker.Pipe through common/pipe_stream.h and pipe_wire.h,
// exactly as between two stages (the sender's payload slice borrows its
// buffer; the receiver copies the payload once into a fresh buffer, as a
// worker into its tensor, or adopts it when it arrived in one slice).
//
// The first message of a stream is a StreamOpen, as in the workers. Its role
// picks what the server does:
//   PEER (stage -> stage): count activations; answer a `done` marker with a
//     `result` whose count is the activations since the previous marker.
//   INPUT_FEED (the coordinator's feed, "inputs down, acks up"): answer every
//     activation with a `done` ack carrying its microbatch number.

// Validates an activation as a worker does and touches it.
absl::Status CheckActivation(const PipeMessage& m) {
  const v1::Tensor& t = m.message.activation();
  if (t.dtype() != v1::FLOAT32 || t.shape_size() != 1) {
    return absl::InvalidArgumentError("activation: expected FLOAT32 of shape [n]");
  }
  const int64_t n = t.shape(0);
  std::shared_ptr<uint8_t> copy;
  const char* data;
  if (m.data.size() == 1) {
    data = reinterpret_cast<const char*>(m.data[0].begin());
  } else {
    // Into a receive buffer, as a worker's EmptyForReceive (stage_worker/tensor_wire.h).
    copy = BufferPool::Receive().Take(m.data_size);
    if (copy == nullptr) return absl::ResourceExhaustedError("activation: no memory");
    m.CopyData(copy.get());
    data = reinterpret_cast<const char*>(copy.get());
  }
  if (!TouchOk(data, n)) {
    return absl::DataLossError("activation.data: contents differ from what was sent");
  }
  return absl::OkStatus();
}

// The receiving side of "Pipe + gloo" (schedule.transport gloo), as a worker
// does it: the stream's reaction posts each payload's receive (into a fresh
// buffer, as a worker into a fresh tensor) and queues the message; one
// consumer thread per stream, like a stage's compute thread, waits for the
// bytes, validates and touches them, counts and acknowledges, in order.
class GlooConsumer {
 public:
  GlooConsumer(DataPlaneEdge* edge, PipeStream* stream, bool ack_each)
      : edge_(edge), stream_(stream), ack_each_(ack_each), thread_([this] { Run(); }) {}
  ~GlooConsumer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // A reaction: never blocks.
  absl::Status OnMessage(PipeMessage m) {
    Item item;
    if (m.message.has_activation()) {
      const v1::Tensor& t = m.message.activation();
      if (t.dtype() != v1::FLOAT32 || t.shape_size() != 1 || t.data_plane_bytes() <= 0) {
        return absl::InvalidArgumentError("activation: expected FLOAT32 [n] over the data plane");
      }
      item.floats = t.shape(0);
      std::shared_ptr<uint8_t> buffer = BufferPool::Receive().Take(t.data_plane_bytes());
      if (buffer == nullptr) return absl::ResourceExhaustedError("activation: no memory");
      item.receive = edge_->PostReceive(DataPlaneEdge::Tag(m.message.microbatch(), ack_each_),
                                        buffer.get(), t.data_plane_bytes(), buffer);
      item.data = std::move(buffer);
    } else if (!m.message.has_done()) {
      return absl::InvalidArgumentError("payload: expected an activation or a done marker");
    }
    item.message = std::move(m.message);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

 private:
  struct Item {
    v1::StageMessage message;
    std::shared_ptr<DataPlaneEdge::Receive> receive;
    std::shared_ptr<uint8_t> data;
    int64_t floats = 0;
  };
  void Run() {
    int64_t count = 0;
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      v1::StageMessage reply;
      if (item.receive) {
        absl::Status st = edge_->Wait(*item.receive);
        if (st.ok() && !TouchOk(reinterpret_cast<const char*>(item.data.get()), item.floats)) {
          st = absl::DataLossError("activation: contents differ from what was sent");
        }
        if (!st.ok()) {
          std::fprintf(stderr, "bench_transport: Pipe+gloo receiver: %s\n", st.ToString().c_str());
          stream_->Close();
          return;
        }
        ++count;
        if (!ack_each_) continue;
        reply.set_microbatch(item.message.microbatch());
        reply.mutable_done();
      } else {
        reply.mutable_result()->set_count(count);
        count = 0;
      }
      stream_->Send(EncodePipeMessage(reply));
    }
  }
  DataPlaneEdge* const edge_;
  PipeStream* const stream_;
  const bool ack_each_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is set
};

class PipeSink final
    : public v1::StageWorker::WithRawCallbackMethod_Pipe<v1::StageWorker::Service> {
 public:
  // With an edge, payloads come over it (the "Pipe + gloo" path).
  explicit PipeSink(DataPlaneEdge* edge = nullptr) : edge_(edge) {}

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Pipe(
      grpc::CallbackServerContext* context) override {
    DataPlaneEdge* edge = edge_;
    return ServePipe(
        context,
        [edge](absl::StatusOr<PipeMessage> first,
               std::shared_ptr<PipeStream> stream) -> grpc::Status {
          if (!first.ok()) return ToGrpc(first.status());
          if (!first->message.has_open()) {
            return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                "open: the first message of a Pipe stream must be a StreamOpen");
          }
          const bool ack_each = first->message.open().role() == v1::StreamOpen::INPUT_FEED;
          PipeStream* s = stream.get();
          if (edge != nullptr) {
            auto consumer = std::make_shared<GlooConsumer>(edge, s, ack_each);
            PipeStream::Callbacks cb;
            cb.on_message = [s, consumer](absl::StatusOr<PipeMessage> m) {
              absl::Status st = m.ok() ? consumer->OnMessage(std::move(*m)) : m.status();
              if (!st.ok()) s->CloseWith(ToGrpc(st), false);
              return st.ok();
            };
            // The consumer (its thread) goes when the stream ends.
            cb.on_end = [consumer](const grpc::Status&) mutable { consumer.reset(); };
            stream->SetCallbacks(std::move(cb), 4);
            return grpc::Status::OK;
          }
          auto count = std::make_shared<int64_t>(0);
          PipeStream::Callbacks cb;
          cb.on_message = [s, ack_each, count](absl::StatusOr<PipeMessage> m) {
            v1::StageMessage reply;
            absl::Status st = m.status();
            if (st.ok() && m->message.has_activation()) {
              st = CheckActivation(*m);
              if (st.ok()) {
                ++*count;
                if (!ack_each) return true;
                reply.set_microbatch(m->message.microbatch());
                reply.mutable_done();
              }
            } else if (st.ok() && m->message.has_done()) {
              reply.mutable_result()->set_count(*count);
              *count = 0;
            } else if (st.ok()) {
              st = absl::InvalidArgumentError("payload: expected an activation or a done marker");
            }
            if (!st.ok()) {
              s->CloseWith(ToGrpc(st), false);
              return false;
            }
            // One small reply per ping or marker: the sender waits for it, so
            // the queue never holds more than one (Send does not block here).
            s->Send(EncodePipeMessage(reply));
            return true;
          };
          stream->SetCallbacks(std::move(cb), 4);
          return grpc::Status::OK;
        });
  }

 private:
  DataPlaneEdge* const edge_;
};

// What the client side of either gRPC path hands its caller: replies, in
// order, or the end of the stream.
class Replies {
 public:
  void Push(grpc::Status st, v1::StageMessage m = {}) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok()) {
      error_ = st;
    } else {
      queue_.push_back(std::move(m));
    }
    cv_.notify_all();
  }
  absl::StatusOr<v1::StageMessage> Pop(const std::string& what) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(60),
                      [&] { return !queue_.empty() || !error_.ok(); })) {
      return absl::DeadlineExceededError(absl::StrCat("no reply to ", what, " in 60 s"));
    }
    if (queue_.empty()) {
      return absl::UnavailableError(
          absl::StrCat("stream broke on ", what, ": ", error_.error_message()));
    }
    v1::StageMessage m = std::move(queue_.front());
    queue_.pop_front();
    return m;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::StageMessage> queue_;
  grpc::Status error_ = grpc::Status::OK;
};

// The message a worker sends: the header, and the payload slice over the
// activation's own buffer (no copy).
grpc::ByteBuffer ActivationMessage(const std::shared_ptr<const Payload>& payload,
                                   uint64_t microbatch) {
  v1::StageMessage m;
  m.set_microbatch(microbatch);
  m.set_phase(v1::TRAIN);
  m.mutable_activation()->set_dtype(v1::FLOAT32);
  m.mutable_activation()->add_shape(payload->floats());
  return EncodePipeMessage(m, {payload->data(), static_cast<size_t>(payload->bytes()), payload});
}

// `gloo`: the "Pipe + gloo" path (schedule.transport gloo): headers on the
// Pipe stream, payload bytes over a GlooEdge pair on loopback, exactly as
// between two stages (stage_worker/stage_host.cc); the edges' rendezvous
// keys go directly from one to the other here, untimed.
class PipePath {
 public:
  explicit PipePath(bool gloo = false) : gloo_(gloo) {}
  ~PipePath() { Stop(); }

  absl::Status Start() {
    if (gloo_) {
      auto options = [](int rank) {
        DataPlaneEdge::Options o;
        o.rank = rank;
        o.bind_host = "127.0.0.1";
        o.max_sends_in_flight = 6;  // the workers' window for 4 stages
        o.name = "bench edge";
        return o;
      };
      up_ = std::make_unique<GlooEdge>(
          options(0),
          [this](const std::string& k, const std::string& v) { return down_->OnPeerKey(k, v); });
      down_ = std::make_unique<GlooEdge>(
          options(1),
          [this](const std::string& k, const std::string& v) { return up_->OnPeerKey(k, v); });
      absl::Status down_connected;
      std::thread t([&] { down_connected = down_->Connect(); });
      absl::Status up_connected = up_->Connect();
      t.join();
      for (const absl::Status& st : {up_connected, down_connected}) {
        if (!st.ok()) return st;
      }
      service_ = std::make_unique<PipeSink>(down_.get());
    }
    auto started =
        StartBenchServer([&](grpc::ServerBuilder& b) { b.RegisterService(service_.get()); });
    if (!started.ok()) return started.status();
    server_ = std::move(started->server);
    channel_ = std::move(started->channel);
    bulk_ = Open(v1::StreamOpen::PEER, &bulk_replies_);
    ping_ = Open(v1::StreamOpen::INPUT_FEED, &ping_replies_);
    return absl::OkStatus();
  }

  void Stop() {
    // First: no receiver may be left waiting for bytes while its stream ends.
    if (up_) up_->Abort("the benchmark ends");
    if (down_) down_->Abort("the benchmark ends");
    for (auto* s : {&bulk_, &ping_}) {
      if (*s) (*s)->CloseAndWait();
      s->reset();
    }
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      server_->Wait();
      server_.reset();
    }
  }

  absl::StatusOr<Throughput> Burst(const std::shared_ptr<const Payload>& payload,
                                   const Bounds& bounds) {
    int64_t sent = 0;
    const Clock::time_point start = Clock::now();
    while (!bounds.Done(sent, start)) {
      if (!Send(*bulk_, payload, sent, false).ok()) break;
      ++sent;
    }
    v1::StageMessage marker;
    marker.mutable_done();
    bulk_->Send(EncodePipeMessage(marker));
    auto reply = bulk_replies_.Pop("the end marker");
    if (!reply.ok()) return reply.status();
    const Clock::time_point end = Clock::now();
    if (!reply->has_result() || reply->result().count() != sent) {
      return absl::DataLossError(
          absl::StrCat("Pipe: sent ", sent, " messages, server counted ", reply->result().count()));
    }
    return Throughput{sent * payload->bytes(), Seconds(start, end)};
  }

  absl::StatusOr<std::vector<double>> PingPong(const std::shared_ptr<const Payload>& payload,
                                               const Bounds& bounds) {
    std::vector<double> micros;
    const Clock::time_point start = Clock::now();
    for (int64_t sent = 0; !bounds.Done(sent, start); ++sent) {
      const Clock::time_point t0 = Clock::now();
      if (auto st = Send(*ping_, payload, sent, true); !st.ok()) return st;
      auto ack = ping_replies_.Pop("a ping");
      if (!ack.ok()) return ack.status();
      micros.push_back(Seconds(t0, Clock::now()) * 1e6);
      if (!ack->has_done() || ack->microbatch() != static_cast<uint64_t>(sent)) {
        return absl::DataLossError(absl::StrCat("Pipe: ack for ping ", sent, " is wrong"));
      }
    }
    return micros;
  }

 private:
  // One activation: on the stream, or its header there and its bytes over
  // the edge (tags: the ping stream's as gradients, so the two never mix).
  absl::Status Send(PipeStream& stream, const std::shared_ptr<const Payload>& payload,
                    uint64_t microbatch, bool ping) {
    if (!gloo_) {
      return stream.Send(ActivationMessage(payload, microbatch))
                 ? absl::OkStatus()
                 : absl::UnavailableError("Pipe: the stream ended");
    }
    v1::StageMessage m;
    m.set_microbatch(microbatch);
    m.set_phase(v1::TRAIN);
    m.mutable_activation()->set_dtype(v1::FLOAT32);
    m.mutable_activation()->add_shape(payload->floats());
    m.mutable_activation()->set_data_plane_bytes(payload->bytes());
    if (!stream.Send(EncodePipeMessage(m))) return absl::UnavailableError("Pipe: the stream ended");
    return up_->Send(DataPlaneEdge::Tag(microbatch, ping), payload->data(),
                     static_cast<size_t>(payload->bytes()), payload);
  }

  std::shared_ptr<PipeStream> Open(v1::StreamOpen::Role role, Replies* replies) {
    v1::StageMessage open;
    open.mutable_open()->set_job_id("bench_transport");
    open.mutable_open()->set_role(role);
    PipeStream::Callbacks cb;
    cb.on_message = [replies](absl::StatusOr<PipeMessage> m) {
      if (!m.ok()) {
        replies->Push(ToGrpc(m.status()));
        return false;
      }
      replies->Push(grpc::Status::OK, std::move(m->message));
      return true;
    };
    cb.on_end = [replies](const grpc::Status& st) {
      replies->Push(st.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream ended") : st);
    };
    // The workers' queue bound for a 4-stage pipeline.
    return OpenPipe(channel_, EncodePipeMessage(open), std::move(cb), 6);
  }

  const bool gloo_;
  std::unique_ptr<DataPlaneEdge> up_, down_;  // gloo_: rank 0 sends, rank 1 receives
  std::unique_ptr<PipeSink> service_ = std::make_unique<PipeSink>();
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<PipeStream> bulk_, ping_;
  Replies bulk_replies_, ping_replies_;
};

// ---------------------------------------------------------------------------
// Bare gRPC: the same bytes as raw ByteBuffers on gRPC's callback API with no
// Pipemare code (a generic service and stub, one write in flight, no codec,
// no queue): how fast gRPC itself streams them, so that the gap between our
// Pipe and TCP splits into gRPC's share and ours. Messages of 8 bytes or less
// are control: the client's end marker (answered with the count of payload
// messages since the last marker) and the server's acks; every payload
// message on the ping stream is answered with an 8-byte ack.

grpc::ByteBuffer Word(uint64_t v) {
  grpc::Slice s(&v, sizeof(v));
  return grpc::ByteBuffer(&s, 1);
}
uint64_t ReadWord(const grpc::ByteBuffer& b) {
  grpc::Slice s;
  uint64_t v = 0;
  if (b.DumpToSingleSlice(&s).ok() && s.size() == sizeof(v)) std::memcpy(&v, s.begin(), sizeof(v));
  return v;
}
// Touches the first and last float, as the other receivers do.
bool TouchSlices(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  if (!b.Dump(&slices).ok() || slices.empty()) return false;
  // A float may straddle two slices: gather the first and last 4 bytes.
  auto gather = [&](size_t offset) {
    float v;
    char* out = reinterpret_cast<char*>(&v);
    size_t at = 0, filled = 0;
    for (const grpc::Slice& slice : slices) {
      const size_t size = slice.size();
      if (at + size > offset) {
        for (size_t i = offset > at ? offset - at : 0; i < size && filled < sizeof(v); ++i) {
          out[filled++] = static_cast<char>(slice.begin()[i]);
        }
      }
      at += size;
      if (filled == sizeof(v)) break;
    }
    return v;
  };
  if (b.Length() < sizeof(float)) return false;
  const float first = gather(0);
  const float last = gather(b.Length() - sizeof(float));
  return first == 0.0f && last == static_cast<float>(b.Length() / sizeof(float) - 1);
}

class BareServerCall final : public grpc::ServerGenericBidiReactor {
 public:
  explicit BareServerCall(bool ack_each) : ack_each_(ack_each) { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    const size_t length = in_.Length();
    if (length > sizeof(uint64_t)) {
      if (!TouchSlices(in_)) {
        Finish(grpc::Status(grpc::StatusCode::DATA_LOSS, "contents differ from what was sent"));
        return;
      }
      ++count_;
      if (!ack_each_) {
        StartRead(&in_);
        return;
      }
      out_ = Word(count_);
    } else {
      out_ = Word(count_);
      count_ = 0;
    }
    StartWrite(&out_);  // the client waits for it: one write in flight
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    StartRead(&in_);
  }
  void OnDone() override { delete this; }

 private:
  const bool ack_each_;
  grpc::ByteBuffer in_, out_;
  uint64_t count_ = 0;
};

class BareService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    return new BareServerCall(ctx->method() == "/bare/ping");
  }
};

class BareClientCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  BareClientCall(grpc::GenericStub* stub, const std::string& method) {
    stub->PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
    AddHold();
    StartCall();
  }
  // Streams `payload` until `bounds` are met, then the end marker; each
  // next write starts from the previous one's reaction (no thread of ours
  // in between: gRPC's best case). Returns the messages sent once the marker
  // is on its way; the caller then Read()s the server's count.
  absl::StatusOr<int64_t> Stream(std::shared_ptr<const Payload> payload, const Bounds& bounds) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !writing_ || broken_; });
      if (broken_) return Broken("write");
      burst_payload_ = std::move(payload);
      burst_bounds_ = bounds;
      burst_start_ = Clock::now();
      burst_sent_ = 1;
      burst_over_ = false;
      writing_ = true;
      out_ = Bytes(burst_payload_);
    }
    StartWrite(&out_);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return burst_over_ || broken_; });
    if (!burst_over_) {
      lock.unlock();
      return Broken("write");
    }
    return burst_sent_;
  }
  // The payload as one slice over its own buffer, as our sender does.
  static grpc::ByteBuffer Bytes(const std::shared_ptr<const Payload>& payload) {
    auto* owner = new std::shared_ptr<const Payload>(payload);
    grpc::Slice s(
        const_cast<char*>(payload->data()), payload->bytes(),
        [](void* p) { delete static_cast<std::shared_ptr<const Payload>*>(p); }, owner);
    return grpc::ByteBuffer(&s, 1);
  }
  // Waits until the previous write is done, then starts this one.
  bool Write(grpc::ByteBuffer b) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !writing_ || broken_; });
    if (broken_) return false;
    writing_ = true;
    out_ = std::move(b);
    lock.unlock();
    StartWrite(&out_);
    return true;
  }
  absl::StatusOr<uint64_t> Read() {
    StartRead(&in_);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return read_done_ || broken_; });
    if (!read_done_) {
      lock.unlock();
      return Broken("read");
    }
    read_done_ = false;
    return ReadWord(in_);
  }
  // Why the stream broke: the status it ended with (the server's check of
  // the contents, a transport error).
  absl::Status Broken(const std::string& what) {
    DropHold();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return absl::UnavailableError(
        absl::StrCat("bare gRPC: ", what, " failed: the stream ended with status ",
                     done_status_.error_code(), " ", done_status_.error_message()));
  }
  void Close() {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !writing_ || broken_; });
    }
    context_.TryCancel();
    DropHold();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
  }
  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (ok && burst_payload_) {
      // In a burst: the next payload, or the end marker after the last.
      if (!burst_bounds_.Done(burst_sent_, burst_start_)) {
        ++burst_sent_;
        out_ = Bytes(burst_payload_);
      } else {
        burst_payload_.reset();
        out_ = Word(0);
      }
      lock.unlock();
      StartWrite(&out_);
      return;
    }
    if (ok && !burst_over_) {
      burst_over_ = true;  // the end marker went out
    }
    writing_ = false;
    broken_ = broken_ || !ok;
    cv_.notify_all();
  }
  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    read_done_ = ok;
    broken_ = broken_ || !ok;
    cv_.notify_all();
  }
  void OnDone(const grpc::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    done_status_ = status;
    broken_ = true;
    cv_.notify_all();
  }

 private:
  grpc::ClientContext context_;
  std::mutex mu_;
  std::condition_variable cv_;
  grpc::ByteBuffer out_, in_;
  // The hold keeps the call open between our writes; dropped once.
  void DropHold() {
    if (!held_.exchange(false)) return;
    RemoveHold();
  }
  std::atomic<bool> held_{true};
  std::shared_ptr<const Payload> burst_payload_;  // set while a burst runs
  Bounds burst_bounds_;
  Clock::time_point burst_start_;
  int64_t burst_sent_ = 0;
  bool burst_over_ = true;
  bool writing_ = false, read_done_ = false, broken_ = false, done_ = false;
  grpc::Status done_status_;
};

class BareGrpcPath {
 public:
  ~BareGrpcPath() { Stop(); }

  absl::Status Start() {
    // Pipemare's server limits and keepalives, without our service.
    auto started = StartBenchServer(
        [&](grpc::ServerBuilder& b) { b.RegisterCallbackGenericService(&service_); });
    if (!started.ok()) return started.status();
    server_ = std::move(started->server);
    channel_ = std::move(started->channel);
    stub_ = std::make_unique<grpc::GenericStub>(channel_);
    bulk_ = std::make_unique<BareClientCall>(stub_.get(), "/bare/bulk");
    ping_ = std::make_unique<BareClientCall>(stub_.get(), "/bare/ping");
    return absl::OkStatus();
  }

  void Stop() {
    if (bulk_) bulk_->Close();
    if (ping_) ping_->Close();
    bulk_.reset();
    ping_.reset();
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      server_->Wait();
      server_.reset();
    }
  }

  absl::StatusOr<Throughput> Burst(const std::shared_ptr<const Payload>& payload,
                                   const Bounds& bounds) {
    const Clock::time_point start = Clock::now();
    auto streamed = bulk_->Stream(payload, bounds);
    if (!streamed.ok()) return streamed.status();
    const int64_t sent = *streamed;
    auto count = bulk_->Read();
    if (!count.ok()) return count.status();
    const Clock::time_point end = Clock::now();
    if (*count != static_cast<uint64_t>(sent)) {
      return absl::DataLossError(absl::StrCat("bare gRPC: sent ", sent, ", counted ", *count));
    }
    return Throughput{sent * payload->bytes(), Seconds(start, end)};
  }

  absl::StatusOr<std::vector<double>> PingPong(const std::shared_ptr<const Payload>& payload,
                                               const Bounds& bounds) {
    std::vector<double> micros;
    const Clock::time_point start = Clock::now();
    for (int64_t sent = 0; !bounds.Done(sent, start); ++sent) {
      const Clock::time_point t0 = Clock::now();
      if (!ping_->Write(BareClientCall::Bytes(payload))) return ping_->Broken("ping");
      auto ack = ping_->Read();
      if (!ack.ok()) return ack.status();
      micros.push_back(Seconds(t0, Clock::now()) * 1e6);
    }
    return micros;
  }

 private:
  BareService service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
  std::unique_ptr<BareClientCall> bulk_, ping_;
};

// ---------------------------------------------------------------------------
// Raw TCP: length-prefixed frames on one loopback connection.

enum FrameKind : uint32_t {
  kData = 1,  // payload; no answer
  kPing = 2,  // payload; answered by kAck carrying the frame's tag
  kEnd = 3,   // no payload; answered by kAck carrying the kData count since the last kEnd
  kAck = 4,   // server -> client
};

struct FrameHeader {
  uint32_t kind;
  uint32_t reserved;
  uint64_t tag;     // kPing: sequence number; kAck: the answer
  uint64_t length;  // payload bytes that follow
};

std::string Errno(const std::string& what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Socket& operator=(Socket&& other) noexcept {
    Close();
    fd_ = std::exchange(other.fd_, -1);
    return *this;
  }
  ~Socket() { Close(); }
  int fd() const { return fd_; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // Writes the header and `length` bytes of `data` with one writev (the header
  // of a small frame does not go out as a segment of its own).
  absl::Status SendFrame(const FrameHeader& header, const char* data) {
    iovec iov[2] = {{const_cast<FrameHeader*>(&header), sizeof(header)},
                    {const_cast<char*>(data), static_cast<size_t>(header.length)}};
    int count = header.length > 0 ? 2 : 1;
    iovec* next = iov;
    while (count > 0) {
      msghdr msg{};
      msg.msg_iov = next;
      msg.msg_iovlen = count;
      const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        return absl::UnavailableError(Errno("TCP send"));
      }
      size_t left = static_cast<size_t>(n);
      while (count > 0 && left >= next->iov_len) {
        left -= next->iov_len;
        ++next;
        --count;
      }
      if (count > 0) {
        next->iov_base = static_cast<char*>(next->iov_base) + left;
        next->iov_len -= left;
      }
    }
    return absl::OkStatus();
  }

  // Reads exactly `bytes`; NotFound on a clean end of stream before the first byte.
  absl::Status RecvAll(void* out, size_t bytes) {
    char* p = static_cast<char*>(out);
    size_t got = 0;
    while (got < bytes) {
      const ssize_t n = ::recv(fd_, p + got, bytes - got, 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        return absl::UnavailableError(Errno("TCP recv"));
      }
      if (n == 0) {
        return got == 0 ? absl::NotFoundError("TCP: peer closed")
                        : absl::DataLossError("TCP: peer closed inside a frame");
      }
      got += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

 private:
  int fd_ = -1;
};

absl::Status SetNoDelay(const Socket& s) {
  const int one = 1;
  if (::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return absl::InternalError(Errno("TCP_NODELAY"));
  }
  return absl::OkStatus();
}

class TcpPath {
 public:
  ~TcpPath() { Stop(); }

  // Listens on 127.0.0.1:0, connects (completes through the backlog), accepts,
  // and only then starts the server thread: no thread waits in accept().
  absl::Status Start() {
    Socket listener(::socket(AF_INET, SOCK_STREAM, 0));
    if (listener.fd() < 0) return absl::InternalError(Errno("TCP socket"));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (::bind(listener.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listener.fd(), 1) != 0 ||
        ::getsockname(listener.fd(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return absl::InternalError(Errno("TCP listen on 127.0.0.1"));
    }
    client_ = Socket(::socket(AF_INET, SOCK_STREAM, 0));
    if (client_.fd() < 0) return absl::InternalError(Errno("TCP socket"));
    if (::connect(client_.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return absl::UnavailableError(Errno("TCP connect to 127.0.0.1"));
    }
    Socket server(::accept(listener.fd(), nullptr, nullptr));
    if (server.fd() < 0) return absl::InternalError(Errno("TCP accept"));
    if (auto st = SetNoDelay(client_); !st.ok()) return st;
    if (auto st = SetNoDelay(server); !st.ok()) return st;
    server_ = std::thread([this, s = std::move(server)]() mutable { server_status_ = Serve(s); });
    return absl::OkStatus();
  }

  // Closing the client's end ends the server's loop; then join it.
  void Stop() {
    if (client_.fd() >= 0) ::shutdown(client_.fd(), SHUT_RDWR);
    if (server_.joinable()) server_.join();
    client_.Close();
  }

 private:
  // The server thread: reads frames into one reusable buffer until the client
  // closes the connection.
  static absl::Status Serve(Socket& s) {
    std::vector<char> buffer;
    int64_t count = 0;
    FrameHeader header;
    while (true) {
      absl::Status st = s.RecvAll(&header, sizeof(header));
      if (absl::IsNotFound(st)) return absl::OkStatus();
      if (!st.ok()) return st;
      if (header.length > static_cast<uint64_t>(kMaxPayloadBytes)) {
        return absl::InvalidArgumentError("TCP: frame too long");
      }
      if (buffer.size() < header.length) buffer.resize(header.length);
      if (st = s.RecvAll(buffer.data(), header.length); !st.ok()) return st;
      const int64_t floats = static_cast<int64_t>(header.length / sizeof(float));
      FrameHeader ack{kAck, 0, 0, 0};
      switch (header.kind) {
        case kData:
          if (!TouchOk(buffer.data(), floats)) return absl::DataLossError("TCP: bad payload");
          ++count;
          break;
        case kPing:
          if (!TouchOk(buffer.data(), floats)) return absl::DataLossError("TCP: bad payload");
          ack.tag = header.tag;
          if (st = s.SendFrame(ack, nullptr); !st.ok()) return st;
          break;
        case kEnd:
          ack.tag = static_cast<uint64_t>(count);
          count = 0;
          if (st = s.SendFrame(ack, nullptr); !st.ok()) return st;
          break;
        default:
          return absl::InvalidArgumentError(absl::StrCat("TCP: unknown frame kind ", header.kind));
      }
    }
  }

  // A failed exchange: stop the server and report what it saw too.
  absl::Status Failed(const absl::Status& st) {
    Stop();
    return server_status_.ok()
               ? st
               : absl::Status(st.code(), absl::StrCat(st.message(),
                                                      " (server: ", server_status_.message(), ")"));
  }

  absl::Status ReadAck(uint64_t* tag) {
    FrameHeader ack;
    if (auto st = client_.RecvAll(&ack, sizeof(ack)); !st.ok()) return st;
    if (ack.kind != kAck || ack.length != 0) return absl::DataLossError("TCP: bad ack frame");
    *tag = ack.tag;
    return absl::OkStatus();
  }

 public:
  // One timed measurement; see MeasureThroughput and MeasureLatency.
  absl::StatusOr<Throughput> Burst(const std::shared_ptr<const Payload>& shared,
                                   const Bounds& bounds) {
    const Payload& payload = *shared;
    if (client_.fd() < 0) return absl::FailedPreconditionError("TCP connection is closed");
    const FrameHeader data{kData, 0, 0, static_cast<uint64_t>(payload.bytes())};
    int64_t sent = 0;
    const Clock::time_point start = Clock::now();
    while (!bounds.Done(sent, start)) {
      if (auto st = client_.SendFrame(data, payload.data()); !st.ok()) return Failed(st);
      ++sent;
    }
    uint64_t count = 0;
    if (auto st = client_.SendFrame(FrameHeader{kEnd, 0, 0, 0}, nullptr); !st.ok()) {
      return Failed(st);
    }
    if (auto st = ReadAck(&count); !st.ok()) return Failed(st);
    const Clock::time_point end = Clock::now();
    if (count != static_cast<uint64_t>(sent)) {
      return Failed(
          absl::DataLossError(absl::StrCat("TCP: sent ", sent, " frames, server counted ", count)));
    }
    return Throughput{sent * payload.bytes(), Seconds(start, end)};
  }

  absl::StatusOr<std::vector<double>> PingPong(const std::shared_ptr<const Payload>& shared,
                                               const Bounds& bounds) {
    const Payload& payload = *shared;
    if (client_.fd() < 0) return absl::FailedPreconditionError("TCP connection is closed");
    std::vector<double> micros;
    const Clock::time_point start = Clock::now();
    for (int64_t sent = 0; !bounds.Done(sent, start); ++sent) {
      const Clock::time_point t0 = Clock::now();
      const FrameHeader ping{kPing, 0, static_cast<uint64_t>(sent),
                             static_cast<uint64_t>(payload.bytes())};
      if (auto st = client_.SendFrame(ping, payload.data()); !st.ok()) return Failed(st);
      uint64_t tag = 0;
      if (auto st = ReadAck(&tag); !st.ok()) return Failed(st);
      micros.push_back(Seconds(t0, Clock::now()) * 1e6);
      if (tag != static_cast<uint64_t>(sent)) {
        return Failed(absl::DataLossError(absl::StrCat("TCP: ack for ping ", sent, " is wrong")));
      }
    }
    return micros;
  }

 private:
  Socket client_;
  std::thread server_;
  absl::Status server_status_;  // written by server_, read after join
};

// ---------------------------------------------------------------------------
// Flags and the report.

// "64K", "1M", "4MiB", "65536" -> bytes.
absl::StatusOr<int64_t> ParseSize(std::string text) {
  text = std::string(absl::StripAsciiWhitespace(text));
  int64_t unit = 1;
  std::string number = text;
  for (const auto& [suffix, factor] : std::vector<std::pair<std::string, int64_t>>{
           {"KiB", kKiB}, {"MiB", kMiB}, {"K", kKiB}, {"M", kMiB}, {"k", kKiB}, {"m", kMiB}}) {
    if (text.size() > suffix.size() &&
        text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0) {
      number = text.substr(0, text.size() - suffix.size());
      unit = factor;
      break;
    }
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(number, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sizes: '", text, "' is not a size (bytes, or a number with K or M)"));
  }
  if (value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--sizes: '", text, "' is not positive"));
  }
  if (value > kMaxPayloadBytes / unit) {
    return absl::InvalidArgumentError(absl::StrCat("--sizes: '", text, "' exceeds the ",
                                                   kMaxPayloadBytes / kMiB,
                                                   " MiB a Pipemare message may carry"));
  }
  value *= unit;
  if (value % static_cast<int64_t>(sizeof(float)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sizes: '", text, "' is not a whole number of FLOAT32 (4 bytes)"));
  }
  return value;
}

absl::StatusOr<std::vector<int64_t>> ParseSizes(const std::string& list) {
  std::vector<int64_t> sizes;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    auto size = ParseSize(std::string(item));
    if (!size.ok()) return size.status();
    sizes.push_back(*size);
  }
  if (sizes.empty()) return absl::InvalidArgumentError("--sizes: empty");
  return sizes;
}

// The three paths, side by side: our Pipe, bare gRPC, raw TCP.
constexpr int kPaths = 4;
const char* const kPathNames[kPaths] = {"Pipe", "Pipe+gloo", "bare gRPC", "TCP"};

struct Row {
  int64_t bytes = 0;
  Throughput best[kPaths];  // best round
  std::vector<double> micros[kPaths];
};

void PrintTable(const std::vector<Row>& rows) {
  std::printf(
      "| size | Pipe GiB/s | Pipe+gloo GiB/s | bare gRPC GiB/s | TCP GiB/s | Pipe/TCP | "
      "Pipe/bare gRPC | gloo/TCP | Pipe µs | Pipe+gloo µs | bare gRPC µs | TCP µs |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    std::printf(
        "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f | %.0f | %.0f |\n",
        SizeName(r.bytes).c_str(), r.best[0].gib_per_s(), r.best[1].gib_per_s(),
        r.best[2].gib_per_s(), r.best[3].gib_per_s(), r.best[0].gib_per_s() / r.best[3].gib_per_s(),
        r.best[0].gib_per_s() / r.best[2].gib_per_s(),
        r.best[1].gib_per_s() / r.best[3].gib_per_s(), Median(r.micros[0]), Median(r.micros[1]),
        Median(r.micros[2]), Median(r.micros[3]));
  }
}

void PrintJson(const std::vector<Row>& rows, const Bounds& bounds, int rounds) {
  std::printf("{\"seconds\": %g, \"messages\": %lld, \"rounds\": %d, \"results\": [",
              bounds.seconds, static_cast<long long>(bounds.messages), rounds);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf(
        "%s\n  {\"bytes\": %lld, \"pipe_gib_per_s\": %.4f, \"pipe_gloo_gib_per_s\": %.4f, "
        "\"bare_grpc_gib_per_s\": %.4f, \"tcp_gib_per_s\": %.4f, \"pipe_latency_us\": %.1f, "
        "\"pipe_gloo_latency_us\": %.1f, \"bare_grpc_latency_us\": %.1f, "
        "\"tcp_latency_us\": %.1f}",
        i == 0 ? "" : ",", static_cast<long long>(r.bytes), r.best[0].gib_per_s(),
        r.best[1].gib_per_s(), r.best[2].gib_per_s(), r.best[3].gib_per_s(), Median(r.micros[0]),
        Median(r.micros[1]), Median(r.micros[2]), Median(r.micros[3]));
  }
  std::printf("\n]}\n");
}

template <typename T>
bool Check(const absl::StatusOr<T>& result, const char* what, int64_t bytes) {
  if (result.ok()) return true;
  std::fprintf(stderr, "bench_transport: %s at %s: %s\n", what, SizeName(bytes).c_str(),
               result.status().ToString().c_str());
  return false;
}

// Throughput of a burst after an untimed warm-up burst, on either path.
template <typename Path>
absl::StatusOr<Throughput> MeasureThroughput(Path& path,
                                             const std::shared_ptr<const Payload>& payload,
                                             const Bounds& bounds) {
  const Bounds warmup{0, std::max<int64_t>(2, kWarmupBytes / payload->bytes())};
  if (auto r = path.Burst(payload, warmup); !r.ok()) return r.status();
  return path.Burst(payload, bounds);
}

// Round trips in microseconds, after a few untimed ones, on either path.
template <typename Path>
absl::StatusOr<std::vector<double>> MeasureLatency(Path& path,
                                                   const std::shared_ptr<const Payload>& payload,
                                                   const Bounds& bounds) {
  if (auto r = path.PingPong(payload, Bounds{0, 3}); !r.ok()) return r.status();
  return path.PingPong(payload, bounds);
}

int Main(int argc, char** argv) {
  CLI::App app{
      "bench_transport: our Pipe stream vs bare gRPC vs raw TCP over loopback (throughput and "
      "latency)"};
  std::string sizes_flag = "64K,256K,1M,4M,16M,64M";
  Bounds bounds;
  int rounds = 2;
  std::string output = "table";
  std::string malloc_mode = "tuned";
  app.add_option("--sizes", sizes_flag, "Payload sizes, comma-separated (bytes, or with K/M)")
      ->capture_default_str();
  app.add_option("--seconds", bounds.seconds,
                 "Time bound of each measurement (0: none; then --messages bounds it)")
      ->capture_default_str();
  app.add_option("--messages", bounds.messages,
                 "Message bound of each measurement (0: none; --seconds bounds it)")
      ->capture_default_str();
  app.add_option("--rounds", rounds,
                 "Repetitions of each measurement, the paths interleaved "
                 "(throughput: best round; latency: median of all pings)")
      ->capture_default_str();
  app.add_option("--output,-o", output, "Output format: table (Markdown) or json")
      ->capture_default_str();
  app.add_option("--max-frame-size", g_max_frame_size,
                 "HTTP/2 max frame size both gRPC paths advertise, 16384 to 16777215 (0: "
                 "gRPC's default)")
      ->check([](const std::string& v) -> std::string {
        const long n = std::strtol(v.c_str(), nullptr, 10);
        return n == 0 || (n >= 16384 && n <= 16777215)
                   ? ""
                   : "0 (gRPC's default) or 16384 to 16777215 bytes";
      });
  app.add_option("--malloc", malloc_mode,
                 "tuned: TuneMallocForLargeMessages() as every Pipemare service calls it; "
                 "default: glibc's defaults")
      ->capture_default_str();
  std::string receive_pool = "on";
  app.add_option("--receive-pool", receive_pool,
                 "on: receivers copy payloads of BufferPool::kMinBytes (1 MiB) or more into "
                 "recycled buffers (common/buffer_pool.h), as the workers do; off: into fresh "
                 "ones")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto sizes = ParseSizes(sizes_flag);
  std::string error;
  if (!sizes.ok()) {
    error = std::string(sizes.status().message());
  } else if (!(bounds.seconds >= 0) || bounds.seconds > 3600) {
    error = absl::StrCat("--seconds: ", bounds.seconds, " is not in [0, 3600]");
  } else if (bounds.messages < 0) {
    error = absl::StrCat("--messages: ", bounds.messages, " is negative");
  } else if (bounds.seconds == 0 && bounds.messages == 0) {
    error = "--seconds, --messages: at least one must be positive, or a measurement never ends";
  } else if (rounds < 1) {
    error = absl::StrCat("--rounds: ", rounds, " is not positive");
  } else if (output != "table" && output != "json") {
    error = absl::StrCat("--output: '", output, "' is not one of table, json");
  } else if (malloc_mode != "tuned" && malloc_mode != "default") {
    error = absl::StrCat("--malloc: '", malloc_mode, "' is not one of tuned, default");
  } else if (receive_pool != "on" && receive_pool != "off") {
    error = absl::StrCat("--receive-pool: '", receive_pool, "' is not one of on, off");
  }
  if (!error.empty()) {
    std::fprintf(stderr, "bench_transport: %s\n", error.c_str());
    return 2;
  }

  if (malloc_mode == "tuned") TuneMallocForLargeMessages();
  BufferPool::Receive().SetEnabled(receive_pool == "on");
  PipePath pipe_path;
  PipePath gloo_path(/*gloo=*/true);
  BareGrpcPath bare_path;
  TcpPath tcp_path;
  for (absl::Status st :
       {pipe_path.Start(), gloo_path.Start(), bare_path.Start(), tcp_path.Start()}) {
    if (!st.ok()) {
      std::fprintf(stderr, "bench_transport: %s\n", st.ToString().c_str());
      return 1;
    }
  }

  std::vector<Row> rows;
  for (int64_t bytes : *sizes) {
    const auto payload = std::make_shared<const Payload>(bytes);
    Row row;
    row.bytes = bytes;
    for (int round = 0; round < rounds; ++round) {
      absl::StatusOr<Throughput> tp[kPaths] = {MeasureThroughput(pipe_path, payload, bounds),
                                               MeasureThroughput(gloo_path, payload, bounds),
                                               MeasureThroughput(bare_path, payload, bounds),
                                               MeasureThroughput(tcp_path, payload, bounds)};
      absl::StatusOr<std::vector<double>> lat[kPaths] = {
          MeasureLatency(pipe_path, payload, bounds), MeasureLatency(gloo_path, payload, bounds),
          MeasureLatency(bare_path, payload, bounds), MeasureLatency(tcp_path, payload, bounds)};
      for (int p = 0; p < kPaths; ++p) {
        if (!Check(tp[p], absl::StrCat(kPathNames[p], " throughput").c_str(), bytes) ||
            !Check(lat[p], absl::StrCat(kPathNames[p], " latency").c_str(), bytes)) {
          return 1;
        }
        if (tp[p]->gib_per_s() > row.best[p].gib_per_s()) row.best[p] = *tp[p];
        row.micros[p].insert(row.micros[p].end(), lat[p]->begin(), lat[p]->end());
      }
      std::fprintf(stderr,
                   "%s round %d: Pipe %.2f, Pipe+gloo %.2f, bare gRPC %.2f, TCP %.2f GiB/s; "
                   "latency %.0f, %.0f, %.0f, %.0f µs\n",
                   SizeName(bytes).c_str(), round + 1, tp[0]->gib_per_s(), tp[1]->gib_per_s(),
                   tp[2]->gib_per_s(), tp[3]->gib_per_s(), Median(*lat[0]), Median(*lat[1]),
                   Median(*lat[2]), Median(*lat[3]));
    }
    rows.push_back(std::move(row));
  }
  pipe_path.Stop();
  gloo_path.Stop();
  bare_path.Stop();
  tcp_path.Stop();

  if (output == "json") {
    PrintJson(rows, bounds, rounds);
  } else {
    PrintTable(rows);
  }
  return 0;
}

}  // namespace
}  // namespace pipemare::bench

int main(int argc, char** argv) { return pipemare::bench::Main(argc, argv); }
