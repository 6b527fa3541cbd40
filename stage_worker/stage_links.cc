#include "stage_worker/stage_links.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/thread_name.h"
#include "pipeline/core/settings.h"

namespace pipemare {
namespace {

constexpr std::chrono::milliseconds kConnectTimeout{10000};

// schedule.data_plane_min_bytes, or its default.
int64_t DataPlaneMinBytes(const v1::ScheduleSpec& schedule) {
  return schedule.has_data_plane_min_bytes() ? schedule.data_plane_min_bytes() : kDataPlaneMinBytes;
}

// "host" of "host:port" or "[v6]:port".
std::string HostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

StageLinks::StageLinks(const v1::StageAssignment& a, std::string self_address,
                       std::shared_ptr<StageMetrics> metrics, size_t window, OnMessage on_message,
                       OnEnd on_end)
    : assignment_(a),
      self_address_(std::move(self_address)),
      metrics_(std::move(metrics)),
      window_(window),
      on_message_(std::move(on_message)),
      on_end_(std::move(on_end)),
      wire_dtype_(SendAs(WireDtypeOf(a.schedule().wire_dtype()))) {}

StageLinks::~StageLinks() {
  Abort("the stage stops");
  CloseAndWait();
}

PipeStream::Callbacks StageLinks::CallbacksFor(Side side) {
  PipeStream::Callbacks callbacks;
  callbacks.on_message = [this, side](absl::StatusOr<PipeMessage> m) {
    return on_message_(side, std::move(m));
  };
  callbacks.on_end = [this, side](const grpc::Status& st) { on_end_(side, st); };
  return callbacks;
}

absl::Status StageLinks::Open() {
  const v1::StageAssignment& a = assignment_;
  const bool first = a.stage() == 0, last = a.stage() + 1 == a.num_stages();
  if (const Transport transport = TransportOf(a.schedule().transport());
      transport != Transport::kGrpc) {
    // One edge per neighbour stage; it connects from the compute thread
    // once the edge's stream is there (ConnectDataPlane).
    for (Side side : {Side::kUpstream, Side::kDownstream}) {
      if (side == Side::kUpstream ? first : last) continue;
      // The largest tensor this edge carries: a microbatch of activations
      // down, or of their gradients up, in the wire dtype. Both ends work it
      // out from the same shape pass, so both skip an edge whose tensors
      // all ride the stream (its idle Gloo pair would still wake its loop
      // thread 100 times a second).
      const auto& shape = side == Side::kUpstream ? a.input_shape() : a.output_shape();
      if (shape.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            side == Side::kUpstream ? "input_shape" : "output_shape",
            ": required on schedule.transport ", TransportName(transport),
            " for a stage with that neighbour (the coordinator's shape pass sets it)"));
      }
      double edge_bytes = static_cast<double>(a.schedule().microbatch_size()) *
                          torch::elementSize(wire_dtype_.value_or(torch::kFloat32));
      for (int64_t dim : shape) edge_bytes *= static_cast<double>(dim);
      if (edge_bytes < static_cast<double>(DataPlaneMinBytes(a.schedule()))) continue;
      DataPlaneEdge::Options o;
      o.rank = side == Side::kUpstream ? 1 : 0;
      o.bind_host = HostOf(self_address_);
      o.connect_timeout = kConnectTimeout;
      o.max_sends_in_flight = window_;
      const int top = side == Side::kUpstream ? a.stage() - 1 : a.stage();
      o.name = absl::StrCat("edge ", top, "-", top + 1);
      auto edge = MakeDataPlaneEdge(transport, std::move(o),
                                    [this, side](const std::string& key, const std::string& value) {
                                      v1::StageMessage m;
                                      m.mutable_data_plane_key()->set_key(key);
                                      m.mutable_data_plane_key()->set_value(value);
                                      return Send(side, std::move(m));
                                    });
      if (!edge.ok()) return edge.status();
      edge_[static_cast<int>(side)] = std::move(*edge);
    }
  }
  if (last) return absl::OkStatus();
  if (a.downstream_address().empty()) {
    return absl::InvalidArgumentError("downstream_address: required for every stage but the last");
  }
  auto channel = MakeChannel(a.downstream_address());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + kConnectTimeout)) {
    return absl::UnavailableError(absl::StrCat("cannot reach downstream stage ", a.stage() + 1,
                                               " at ", a.downstream_address()));
  }
  v1::StageMessage open;
  open.mutable_open()->set_job_id(a.job_id());
  open.mutable_open()->set_role(v1::StreamOpen::PEER);
  open.mutable_open()->set_from_stage(a.stage());
  open.mutable_open()->set_generation(a.generation());
  auto link = OpenPipe(channel, EncodePipeMessage(open), CallbacksFor(Side::kDownstream), window_);
  std::lock_guard<std::mutex> lock(mu_);
  link_[static_cast<int>(Side::kDownstream)] = std::move(link);
  return absl::OkStatus();
}

grpc::Status StageLinks::Attach(const v1::StreamOpen& open, std::shared_ptr<PipeStream> stream) {
  const int stage = assignment_.stage();
  if (open.generation() != assignment_.generation()) {
    // Fencing: a stage or feed of another run of this job (cut off, then
    // back) never feeds this one.
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("open.generation: stage ", stage, " of job ", assignment_.job_id(),
                     " runs generation ", assignment_.generation(), "; a stream of generation ",
                     open.generation(), " belongs to another run and is refused"));
  }
  Side side = Side::kNone;
  switch (open.role()) {
    case v1::StreamOpen::PEER:
      if (stage == 0 || open.from_stage() != stage - 1) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("open.from_stage: stage ", stage,
                                         " accepts a peer stream only from stage ", stage - 1,
                                         ", not ", open.from_stage()));
      }
      side = Side::kUpstream;
      break;
    case v1::StreamOpen::INPUT_FEED:
      if (stage != 0) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("open.role: INPUT_FEED goes to stage 0, this is stage ", stage));
      }
      side = Side::kUpstream;
      break;
    case v1::StreamOpen::TARGET_FEED:
      if (stage + 1 != assignment_.num_stages()) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("open.role: TARGET_FEED goes to the last stage, this is stage ", stage));
      }
      side = Side::kTargets;
      break;
    default:
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "open.role: must be PEER, INPUT_FEED or TARGET_FEED");
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<PipeStream>& slot = link_[static_cast<int>(side)];
  if (slot != nullptr) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        "this stage already has that stream attached");
  }
  if (aborted_) return grpc::Status(grpc::StatusCode::CANCELLED, "stage is stopping");
  stream->SetCallbacks(CallbacksFor(side), window_);
  slot = std::move(stream);
  cv_.notify_all();  // ConnectDataPlane waits for it
  return grpc::Status::OK;
}

absl::Status StageLinks::ConnectDataPlane() {
  // Both edges at once. One after the other, a stage's downstream pair
  // waited for its upstream one, so a pipeline's pairs connected in a
  // chain, stage after stage, while the first microbatches waited.
  std::atomic<bool> given_up{false};
  auto connect = [&](Side side) -> absl::Status {
    DataPlaneEdge* edge = Edge(side);
    if (edge == nullptr) return absl::OkStatus();
    {
      // The upstream stream arrives when the stage above starts.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return aborted_ || given_up || link_[static_cast<int>(side)]; });
      if (aborted_ || given_up) return absl::CancelledError("the stage stops");
    }
    const auto start = std::chrono::steady_clock::now();
    absl::Status st = edge->Connect();
    if (!st.ok()) return st;
    LogInfo(
        ForStage(assignment_.job_id(), assignment_.stage()),
        absl::StrCat(
            "data plane (", assignment_.schedule().transport(), ") to the ", SideName(side),
            " connected in ",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), " s"));
    return st;
  };
  // The first failure stops the other side's wait at once.
  auto give_up = [&](Side other, const absl::Status& why) {
    if (why.ok()) return;
    given_up = true;
    if (DataPlaneEdge* edge = Edge(other)) edge->Abort(std::string(why.message()));
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  };
  absl::Status downstream;
  std::thread helper([&] {
    NameThisThread("stage-connect");
    downstream = connect(Side::kDownstream);
    give_up(Side::kUpstream, downstream);
  });
  absl::Status upstream = connect(Side::kUpstream);
  give_up(Side::kDownstream, upstream);
  helper.join();
  // The cause, not the other side's cancellation.
  if (!upstream.ok() && !absl::IsCancelled(upstream)) return upstream;
  return downstream.ok() ? upstream : downstream;
}

absl::Status StageLinks::OnPeerKey(Side side, const v1::DataPlaneKey& key) {
  DataPlaneEdge* edge = Edge(side);
  if (edge == nullptr) {
    return absl::InvalidArgumentError(
        "a data_plane_key on a stream without a data plane (schedule.transport is grpc)");
  }
  return edge->OnPeerKey(key.key(), key.value());
}

absl::StatusOr<torch::Tensor> StageLinks::ReceiveTensor(Side side, const PipeMessage& message,
                                                        std::shared_ptr<void>* arriving) {
  const v1::Tensor* header = PayloadTensor(message.message);
  if (header == nullptr || header->data_plane_bytes() == 0) return FromWire(message, ReceiveAs());
  DataPlaneEdge* edge = Edge(side);
  if (edge == nullptr) {
    return absl::InvalidArgumentError(
        "tensor.data_plane_bytes: set, but this stream has no data plane (schedule.transport is "
        "grpc)");
  }
  auto type = TorchType(header->dtype());
  if (!type) return absl::InvalidArgumentError("tensor.dtype: not a LibTorch type");
  // Decoding checked data_plane_bytes against dtype and shape.
  auto empty =
      EmptyForReceive(std::vector<int64_t>(header->shape().begin(), header->shape().end()), *type);
  if (!empty.ok()) return empty.status();
  torch::Tensor t = std::move(*empty);
  *arriving =
      edge->PostReceive(DataPlaneEdge::Tag(message.message.microbatch(), side == Side::kDownstream),
                        t.data_ptr(), t.nbytes(), std::make_shared<torch::Tensor>(t));
  return t;
}

absl::Status StageLinks::Wait(Side side, const std::shared_ptr<void>& arriving,
                              torch::Tensor* tensor) {
  DataPlaneEdge* edge = Edge(side);
  if (edge == nullptr) return absl::InternalError("bytes arriving on a side with no data plane");
  auto receive = std::static_pointer_cast<DataPlaneEdge::Receive>(arriving);
  if (auto st = edge->Wait(*receive); !st.ok()) return st;
  const auto as = ReceiveAs();
  if (as && tensor->is_floating_point() && tensor->scalar_type() != *as) *tensor = tensor->to(*as);
  return absl::OkStatus();
}

absl::Status StageLinks::Send(Side side, v1::StageMessage message, WirePayload payload) {
  std::shared_ptr<PipeStream> link = Link(side);
  if (link == nullptr) return absl::UnavailableError(absl::StrCat("no ", SideName(side)));
  DataPlaneEdge* edge = Edge(side);
  // Eager below data_plane_min_bytes: the bytes ride the stream.
  const bool plane =
      edge != nullptr && payload.size > 0 &&
      static_cast<int64_t>(payload.size) >= DataPlaneMinBytes(assignment_.schedule());
  if (plane) {
    MutablePayloadTensor(&message)->set_data_plane_bytes(static_cast<int64_t>(payload.size));
    (side == Side::kUpstream ? metrics_->data_plane_gradient_bytes
                             : metrics_->data_plane_activation_bytes)
        ->Increment(static_cast<double>(payload.size));
  }
  if (!link->Send(EncodePipeMessage(message, plane ? WirePayload{} : std::move(payload)))) {
    // The stream has reported its end (or we stop).
    return absl::UnavailableError(absl::StrCat("lost its ", SideName(side)));
  }
  if (plane) {
    // After its header: the receiver posts the receive when that arrives.
    return edge->Send(DataPlaneEdge::Tag(message.microbatch(), side == Side::kUpstream),
                      payload.data, payload.size, std::move(payload.owner));
  }
  return absl::OkStatus();
}

void StageLinks::CloseWith(Side side, const grpc::Status& status) {
  // The sender hears why in the stream's status (an incoming stream ends
  // with it; ours to the downstream stage is cancelled), not in a message:
  // gRPC hands a client the status only after it read every message.
  if (auto link = Link(side)) link->CloseWith(status, side == Side::kDownstream);
}

void StageLinks::ResumeReading(Side side) {
  if (auto link = Link(side)) link->ResumeReading();
}

void StageLinks::Abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }
  for (auto& edge : edge_) {
    if (edge) edge->Abort(why);  // a compute thread waiting on it returns
  }
}

void StageLinks::SendLast(Side from, const v1::StageMessage& message) {
  for (Side side : {Side::kUpstream, Side::kDownstream, Side::kTargets}) {
    if (side == from) continue;
    if (auto link = Link(side)) link->SendLast(EncodePipeMessage(message));
  }
}

void StageLinks::CloseAndWait() {
  // After this no stream calls back (a compute thread blocked in a full
  // stream's Send is released too).
  for (int side = 0; side < kSides; ++side) {
    if (auto link = Link(static_cast<Side>(side))) link->CloseAndWait();
  }
}

std::shared_ptr<PipeStream> StageLinks::Link(Side side) const {
  std::lock_guard<std::mutex> lock(mu_);
  return link_[static_cast<int>(side)];
}

DataPlaneEdge* StageLinks::Edge(Side side) const {
  return side == Side::kUpstream || side == Side::kDownstream ? edge_[static_cast<int>(side)].get()
                                                              : nullptr;
}

std::string StageLinks::SideName(Side side) const {
  const int stage = assignment_.stage();
  switch (side) {
    case Side::kDownstream:
      return absl::StrCat("downstream stage ", stage + 1, " at ", assignment_.downstream_address());
    case Side::kTargets:
      return "target feed from the coordinator";
    case Side::kUpstream:
      return stage == 0 ? "input feed from the coordinator"
                        : absl::StrCat("upstream stage ", stage - 1);
    default:
      return "stream";
  }
}

}  // namespace pipemare
