#include "stage_worker/stage_host.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/thread_name.h"
#include "pipeline/torch_codec.h"
#include "stage_worker/tensor_wire.h"

namespace pipemare {
namespace {

constexpr double kConnectSeconds = 10;

// schedule.data_plane_min_bytes, or its default.
int64_t DataPlaneMinBytes(const v1::ScheduleSpec& schedule) {
  return schedule.has_data_plane_min_bytes() ? schedule.data_plane_min_bytes() : kDataPlaneMinBytes;
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Whether every element of `t` is finite. One vectorized pass in the
// common case: a NaN or Inf element makes the sum NaN or Inf, so a finite
// sum proves them all finite; only a non-finite sum (a bad element, or
// finite elements that overflow the sum) takes the exact, masked check.
bool AllFinite(const torch::Tensor& t) {
  if (!t.is_floating_point() || t.numel() == 0) return true;
  if (std::isfinite(t.sum().item<double>())) return true;
  return torch::isfinite(t).all().item<bool>();
}

std::string ShapeText(c10::IntArrayRef sizes) { return c10::str(sizes); }

// "host" of "host:port" or "[v6]:port".
std::string HostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

StageHost::StageHost(const v1::StageAssignment& a, const std::string& self_address)
    : assignment_(a), self_address_(self_address), skip_nonfinite_(a.on_nonfinite() == "skip") {}

absl::StatusOr<std::shared_ptr<StageHost>> StageHost::Start(
    const v1::StageAssignment& a, torch::Device device, const std::string& self_address,
    std::shared_ptr<StageMetrics> metrics, VirtualDevice virtual_device,
    const std::vector<RetainedCut>* memory) {
  auto runtime = StageRuntime::Create(a, device, torch::kFloat32, virtual_device);
  if (!runtime.ok()) return runtime.status();
  std::shared_ptr<StageHost> host(new StageHost(a, self_address));
  host->runtime_ = std::move(*runtime);
  host->metrics_ = std::move(metrics);
  host->metrics_->Update(host->runtime_->Stats());
  if (a.start_step() < 0 || a.start_step() > a.total_steps()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "start_step: ", a.start_step(), " is not in 0..total_steps (", a.total_steps(), ")"));
  }
  if (a.restore_size() > 0 || a.start_step() > 0) {
    // Resume: this stage's units from a checkpoint cut (any partition's).
    // A unit this worker itself wrote to that very file (same path, same
    // SHA-256) comes from its memory of the cut: no disk read.
    std::vector<UnitState> units;
    int from_memory = 0;
    for (const auto& f : a.restore()) {
      if (f.unit() < a.first_unit() || f.unit() >= a.first_unit() + a.units()) continue;
      const UnitState* held = FindRetainedUnit(memory, f);
      if (held != nullptr) {
        units.push_back(*held);
        ++from_memory;
        continue;
      }
      auto unit = ReadUnitFile(f.path(), f.sha256());
      if (!unit.ok()) return unit.status();
      units.push_back(std::move(*unit));
    }
    if (a.restore_weights_only() && a.start_step() != 0) {
      return absl::InvalidArgumentError(
          "restore_weights_only: weights alone start at step 0 (start_step must be 0)");
    }
    if (auto st = host->runtime_->Restore(units, a.start_step(), a.restore_weights_only());
        !st.ok()) {
      return st;
    }
    host->restored_from_memory_ = !units.empty() && from_memory == static_cast<int>(units.size());
    host->metrics_->Update(host->runtime_->Stats());
    LogInfo(ForStage(a.job_id(), a.stage()),
            absl::StrCat("restored units [", a.first_unit(), ", ", a.first_unit() + a.units(),
                         ") from the checkpoint at step ", a.start_step(), " (", from_memory,
                         " of ", units.size(), " from memory)"));
  }
  auto executor = StageExecutor::Create(a, host->runtime_.get());
  if (!executor.ok()) return executor.status();
  host->executor_.emplace(std::move(*executor));
  host->wire_dtype_ = WireScalarType(a.schedule().wire_dtype());
  // The coordinator keeps at most P + 1 (asynchronous) or 2N (synchronous)
  // microbatches in flight, so these bounds only bite on a misbehaving peer:
  // then they push back.
  const size_t window =
      static_cast<size_t>(std::max(a.num_stages(), 2 * a.schedule().microbatches_per_step())) + 2;
  host->inbox_capacity_ = window;
  if (const std::string& transport = a.schedule().transport();
      !transport.empty() && transport != "grpc") {
    // One edge per neighbour stage; it connects from the compute thread
    // once the edge's stream is there (ConnectDataPlane).
    for (Side side : {Side::kUpstream, Side::kDownstream}) {
      if (side == Side::kUpstream ? host->runtime_->is_first() : host->runtime_->is_last()) {
        continue;
      }
      // The largest tensor this edge carries: a microbatch of activations
      // down, or of their gradients up, in the wire dtype. Both ends work it
      // out from the same shape pass, so both skip an edge whose tensors
      // all ride the stream (its idle Gloo pair would still wake its loop
      // thread 100 times a second).
      const auto& shape = side == Side::kUpstream ? a.input_shape() : a.output_shape();
      if (shape.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            side == Side::kUpstream ? "input_shape" : "output_shape",
            ": required on schedule.transport ", transport,
            " for a stage with that neighbour (the coordinator's shape pass sets it)"));
      }
      double edge_bytes = static_cast<double>(a.schedule().microbatch_size()) *
                          torch::elementSize(host->wire_dtype_.value_or(torch::kFloat32));
      for (int64_t dim : shape) edge_bytes *= static_cast<double>(dim);
      if (edge_bytes < static_cast<double>(DataPlaneMinBytes(a.schedule()))) continue;
      DataPlaneEdge::Options o;
      o.rank = side == Side::kUpstream ? 1 : 0;
      o.bind_host = HostOf(self_address);
      o.connect_timeout = std::chrono::milliseconds(static_cast<int>(kConnectSeconds * 1000));
      o.max_sends_in_flight = window;
      const int top = side == Side::kUpstream ? a.stage() - 1 : a.stage();
      o.name = absl::StrCat("edge ", top, "-", top + 1);
      StageHost* h = host.get();
      auto edge = MakeDataPlaneEdge(transport, std::move(o),
                                    [h, side](const std::string& key, const std::string& value) {
                                      v1::StageMessage m;
                                      m.mutable_data_plane_key()->set_key(key);
                                      m.mutable_data_plane_key()->set_value(value);
                                      return h->Send(side, std::move(m));
                                    });
      if (!edge.ok()) return edge.status();
      host->edge_[static_cast<int>(side)] = std::move(*edge);
    }
  }
  if (!host->runtime_->is_last()) {
    if (a.downstream_address().empty()) {
      return absl::InvalidArgumentError(
          "downstream_address: required for every stage but the last");
    }
    auto channel = MakeChannel(a.downstream_address());
    if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                   std::chrono::milliseconds(int(kConnectSeconds * 1000)))) {
      return absl::UnavailableError(absl::StrCat("cannot reach downstream stage ", a.stage() + 1,
                                                 " at ", a.downstream_address()));
    }
    v1::StageMessage open;
    open.mutable_open()->set_job_id(a.job_id());
    open.mutable_open()->set_role(v1::StreamOpen::PEER);
    open.mutable_open()->set_from_stage(a.stage());
    open.mutable_open()->set_generation(a.generation());
    StageHost* h = host.get();
    PipeStream::Callbacks callbacks;
    callbacks.on_message = [h](absl::StatusOr<PipeMessage> m) {
      return h->OnMessage(Side::kDownstream, std::move(m));
    };
    callbacks.on_end = [h](const grpc::Status& st) { h->OnStreamEnd(Side::kDownstream, st); };
    auto link = OpenPipe(channel, EncodePipeMessage(open), std::move(callbacks), window);
    std::lock_guard<std::mutex> lock(host->mu_);
    host->link_[static_cast<int>(Side::kDownstream)] = std::move(link);
  }
  host->checkpoint_thread_ = std::thread([h = host.get()] { h->CheckpointLoop(); });
  host->compute_thread_ = std::thread([h = host.get()] { h->ComputeLoop(); });
  return host;
}

StageHost::~StageHost() { Stop(); }

namespace {
// What a stage reports of the files a cut became.
void AddFiles(const std::vector<WrittenFile>& files, v1::CheckpointWritten* out) {
  for (const WrittenFile& f : files) {
    v1::CheckpointFile* file = out->add_files();
    file->set_unit(f.unit);
    file->set_path(f.path);
    file->set_bytes(f.bytes);
    file->set_sha256(f.sha256);
  }
}
}  // namespace

const UnitState* FindRetainedUnit(const std::vector<RetainedCut>* memory,
                                  const v1::CheckpointFile& file) {
  if (memory == nullptr) return nullptr;
  for (const RetainedCut& cut : *memory) {
    for (size_t i = 0; i < cut.files.size() && i < cut.snapshot->units.size(); ++i) {
      const WrittenFile& w = cut.files[i];
      if (w.unit == file.unit() && w.path == file.path() && w.sha256 == file.sha256() &&
          cut.snapshot->units[i].unit == file.unit()) {
        return &cut.snapshot->units[i];
      }
    }
  }
  return nullptr;
}

void StageHost::NoteCommitted(int64_t step) {
  std::lock_guard<std::mutex> lock(checkpoint_mu_);
  if (step <= committed_step_) return;
  committed_step_ = step;
  PruneRetainedLocked();
}

void StageHost::PruneRetainedLocked() {
  // A recovery rolls back to the committed cut, or to one committed after
  // this stage was asked: keep the newest cut at or before committed_step_
  // and the newest kNewerCuts after it.
  if (retained_.empty()) return;
  while (retained_.size() > 1 && retained_[1].snapshot->step <= committed_step_) {
    retained_.pop_front();
  }
  const size_t base = retained_.front().snapshot->step <= committed_step_ ? 1 : 0;
  while (retained_.size() > base + kNewerCuts) {
    retained_.erase(retained_.begin() + static_cast<std::ptrdiff_t>(base));
  }
}

std::vector<RetainedCut> StageHost::Retained() const {
  std::lock_guard<std::mutex> lock(checkpoint_mu_);
  return {retained_.begin(), retained_.end()};
}

void StageHost::Stop() {
  stopping_ = true;
  cv_.notify_all();
  {
    std::lock_guard<std::mutex> lock(checkpoint_mu_);  // no lost wake-up in QueueCut
  }
  checkpoint_cv_.notify_all();
  for (auto& edge : edge_) {
    if (edge) edge->Abort("the stage stops");  // a compute thread waiting on it returns
  }
  // After this no stream calls into the host (a compute thread blocked in
  // a full stream's Send is released too).
  for (int side = 0; side < kSides; ++side) {
    if (auto link = Link(static_cast<Side>(side))) link->CloseAndWait();
  }
  if (compute_thread_.joinable() && compute_thread_.get_id() != std::this_thread::get_id()) {
    compute_thread_.join();
  }
  {
    std::lock_guard<std::mutex> lock(checkpoint_mu_);
    checkpoint_stop_ = true;  // cuts already taken are still written
  }
  checkpoint_cv_.notify_all();
  if (checkpoint_thread_.joinable() && checkpoint_thread_.get_id() != std::this_thread::get_id()) {
    checkpoint_thread_.join();
  }
}

void StageHost::CheckpointLoop() {
  NameThisThread("stage-ckpt");
  // Writing a cut is background work: on a host whose cores are all busy
  // training it runs on what the compute threads leave (Linux nice is per
  // thread). Failing to lower it is harmless.
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
  const std::string& dir = assignment_.checkpoint_dir();
  for (;;) {
    std::shared_ptr<const StageSnapshot> snapshot;
    {
      std::unique_lock<std::mutex> lock(checkpoint_mu_);
      checkpoint_cv_.wait(lock, [&] { return checkpoint_stop_ || !checkpoint_queue_.empty(); });
      if (checkpoint_queue_.empty()) return;
      snapshot = std::move(checkpoint_queue_.front());
      checkpoint_queue_.pop_front();
    }
    checkpoint_cv_.notify_all();  // a stage waiting in QueueCut
    const auto start = std::chrono::steady_clock::now();
    auto files = dir.empty() ? absl::FailedPreconditionError(
                                   "checkpoint_dir: the coordinator sent none; nothing is saved")
                             : WriteStageSnapshot(dir, assignment_.job_id(), *snapshot);
    std::lock_guard<std::mutex> lock(checkpoint_mu_);
    if (!files.ok()) {
      checkpoint_written_.set_error(
          absl::StrCat("checkpoint at step ", snapshot->step, ": ", files.status().message()));
      LogError(ForStage(assignment_.job_id(), assignment_.stage()), checkpoint_written_.error());
      continue;
    }
    checkpoint_written_.set_step(snapshot->step);
    checkpoint_written_.set_generation(snapshot->generation);
    checkpoint_written_.clear_files();
    // The newest cuts stay in memory: a recovery that rolls back to one of
    // them restores this stage without reading disk.
    retained_.push_back(RetainedCut{snapshot, *files});
    PruneRetainedLocked();
    AddFiles(*files, &checkpoint_written_);
    int64_t bytes = 0;
    for (const WrittenFile& f : *files) bytes += f.bytes;
    metrics_->checkpoint_write_seconds->Observe(SecondsSince(start));
    metrics_->checkpoint_bytes->Increment(static_cast<double>(bytes));
    LogInfo(ForStage(assignment_.job_id(), assignment_.stage()),
            absl::StrCat("checkpoint at step ", snapshot->step, ": ", files->size(), " units, ",
                         bytes, " bytes in ", SecondsSince(start), " s"));
  }
}

grpc::Status StageHost::Attach(const v1::StreamOpen& open, std::shared_ptr<PipeStream> stream) {
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
      if (!runtime_->is_last()) {
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
  if (stopping_ || failed_) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "stage is stopping");
  }
  PipeStream::Callbacks callbacks;
  callbacks.on_message = [this, side](absl::StatusOr<PipeMessage> m) {
    return OnMessage(side, std::move(m));
  };
  callbacks.on_end = [this, side](const grpc::Status& st) { OnStreamEnd(side, st); };
  stream->SetCallbacks(std::move(callbacks), inbox_capacity_);
  slot = std::move(stream);
  cv_.notify_all();  // ConnectDataPlane waits for it
  return grpc::Status::OK;
}

bool StageHost::OnMessage(Side side, absl::StatusOr<PipeMessage> message) {
  const int stage = assignment_.stage();
  std::string why;
  if (!message.ok()) {
    why = std::string(message.status().message());
  } else if (message->message.has_error()) {
    const int code = message->message.error().code();
    Fail(message->message.error().message(), side,
         code == 0 ? absl::StatusCode::kUnavailable : static_cast<absl::StatusCode>(code));
    return false;
  } else if (message->message.has_data_plane_key()) {
    DataPlaneEdge* edge = side == Side::kUpstream || side == Side::kDownstream
                              ? edge_[static_cast<int>(side)].get()
                              : nullptr;
    if (edge == nullptr) {
      why = "a data_plane_key on a stream without a data plane (schedule.transport is grpc)";
    } else if (auto st = edge->OnPeerKey(message->message.data_plane_key().key(),
                                         message->message.data_plane_key().value());
               !st.ok()) {
      why = std::string(st.message());
    } else {
      return true;
    }
  } else if (side == Side::kDownstream) {
    if (!message->message.has_gradient()) {
      why = "downstream sent something that is not a gradient";
    } else {
      std::shared_ptr<DataPlaneEdge::Receive> arriving;
      auto t = ReceiveTensor(side, *message, &arriving);
      const uint64_t id = message->message.microbatch();
      if (!t.ok()) {
        why = absl::StrCat("gradient of microbatch ", id, ": ", t.status().message());
      } else {
        metrics_->received_gradient_bytes->Increment(static_cast<double>(
            message->data_size + message->message.gradient().data_plane_bytes()));
        {
          std::lock_guard<std::mutex> lock(mu_);
          // Only for a training activation this stage sent and still awaits
          // a gradient for, of the shape it sent; never more gradients than
          // microbatches in flight below this stage (the coordinator's
          // window).
          auto sent = awaiting_gradient_.find(id);
          if (sent == awaiting_gradient_.end()) {
            why = id > last_sent_
                      ? absl::StrCat("gradient of microbatch ", id,
                                     ", which this stage never sent downstream")
                      : absl::StrCat("stale gradient of microbatch ", id,
                                     ": its gradient already arrived, or it was not a training "
                                     "microbatch");
          } else if (!t->sizes().equals(sent->second)) {
            why = absl::StrCat("gradient of microbatch ", id, " has shape ", ShapeText(t->sizes()),
                               " but the activation sent was ", ShapeText(sent->second));
          } else if (message->message.gradient().dtype() !=
                     WireDType(wire_dtype_.value_or(torch::kFloat32))) {
            why = absl::StrCat("gradient of microbatch ", id, " is ",
                               v1::DType_Name(message->message.gradient().dtype()), " but ",
                               v1::DType_Name(WireDType(wire_dtype_.value_or(torch::kFloat32))),
                               " was sent (schedule.wire_dtype)");
          } else if (gradients_.size() >= inbox_capacity_) {
            why = absl::StrCat("gradient of microbatch ", id, ": more than ", inbox_capacity_,
                               " gradients waiting, more than the pipeline's window allows");
          } else {
            awaiting_gradient_.erase(sent);
          }
        }
        if (why.empty()) {
          Event e{true, id, v1::TRAIN, *t};
          e.arriving = std::move(arriving);
          e.from = side;
          if (!e.arriving && !AllFinite(e.tensor)) {
            if (!OnNonFinite(id, "gradient", side)) return false;
            e.skipped = true;
            e.tensor = torch::zeros_like(e.tensor);
          }
          {
            std::lock_guard<std::mutex> lock(mu_);
            gradients_.push_back(std::move(e));
          }
          cv_.notify_all();
          return true;
        }
      }
    }
  } else if (side == Side::kTargets) {
    if (!message->message.has_targets()) {
      why = "the target feed may only carry targets";
    } else {
      auto t = FromWire(*message);
      if (!t.ok()) {
        why = absl::StrCat("targets of microbatch ", message->message.microbatch(), ": ",
                           t.status().message());
      } else {
        metrics_->received_targets_bytes->Increment(t->nbytes());
        const uint64_t id = message->message.microbatch();
        {
          std::lock_guard<std::mutex> lock(mu_);
          // The feed sends targets only for microbatches in the window, in
          // increasing id order.
          if (targets_.size() >= inbox_capacity_) {
            why = absl::StrCat("targets of microbatch ", id, ": more than ", inbox_capacity_,
                               " targets waiting, more than the pipeline's window allows");
          } else if (targets_.count(id)) {
            why = absl::StrCat("targets of microbatch ", id, " arrived twice");
          } else if (id <= last_targets_) {
            why = absl::StrCat("targets of microbatch ", id, " arrived after microbatch ",
                               last_targets_, "'s: a stale id (ids only increase)");
          } else {
            targets_.emplace(id, *t);
            last_targets_ = id;
          }
        }
        if (why.empty()) {
          cv_.notify_all();
          return true;
        }
      }
    }
  } else if (!message->message.has_activation()) {
    why = "an upstream stream may only carry activations";
  } else {
    // Stage 0's input feed is float32 already; peers may send a wire dtype.
    const uint64_t id = message->message.microbatch();
    std::shared_ptr<DataPlaneEdge::Receive> arriving;
    auto t = ReceiveTensor(side, *message, &arriving);
    if (!t.ok()) {
      why = absl::StrCat("activation of microbatch ", id, ": ", t.status().message());
    } else if (why = CheckActivation(id, message->message.activation(), *t); why.empty()) {
      {
        // (One message at a time per stream: nothing else moves it.)
        std::lock_guard<std::mutex> lock(mu_);
        if (id <= last_activation_) {
          why = absl::StrCat("activation of microbatch ", id, " arrived after microbatch ",
                             last_activation_,
                             "'s: a duplicate or out-of-order id (ids only increase)");
        } else {
          last_activation_ = id;
        }
      }
      if (why.empty()) {
        metrics_->received_activation_bytes->Increment(static_cast<double>(
            message->data_size + message->message.activation().data_plane_bytes()));
        Event e{false, id, message->message.phase(), *t};
        e.skipped = message->message.skipped();
        e.arriving = std::move(arriving);
        e.from = side;
        if (!e.arriving) {  // else Arrive() checks it, once its bytes are there
          if (!e.skipped && !AllFinite(e.tensor)) {
            if (!OnNonFinite(id, "activation", side)) return false;
            e.skipped = true;
          }
          if (e.skipped) e.tensor = torch::zeros_like(e.tensor);
        }
        bool more;
        {
          std::lock_guard<std::mutex> lock(mu_);
          activations_.push_back(std::move(e));
          // A full inbox stops reading: backpressure on the sender.
          more = activations_.size() < inbox_capacity_;
          if (!more) upstream_paused_ = true;
        }
        cv_.notify_all();
        return more;
      }
    }
  }
  Fail(absl::StrCat("stage ", stage, " (", self_address_, "): bad message from its ",
                    SideName(side), ": ", why),
       side);
  // The sender hears why in the stream's status (an incoming stream ends
  // with it; ours to the downstream stage is cancelled), not in a message:
  // gRPC hands a client the status only after it read every message.
  if (auto link = Link(side)) {
    link->CloseWith(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why),
                    side == Side::kDownstream);
  }
  return false;
}

std::string StageHost::CheckActivation(uint64_t id, const v1::Tensor& header,
                                       const torch::Tensor& t) const {
  const bool feed = assignment_.stage() == 0;
  const v1::DType want = feed && assignment_.token_input() ? v1::INT64
                         : feed                            ? v1::FLOAT32
                                : WireDType(wire_dtype_.value_or(torch::kFloat32));
  if (header.dtype() != want) {
    return absl::StrCat("activation of microbatch ", id, " is ", v1::DType_Name(header.dtype()),
                        " but this stage takes ", v1::DType_Name(want),
                        feed ? "" : " (schedule.wire_dtype)");
  }
  const auto& example = assignment_.input_shape();
  bool fits = t.dim() >= 1 && t.size(0) >= 1;
  if (fits && !example.empty()) {
    fits = t.dim() == example.size() + 1;
    for (int j = 0; fits && j < example.size(); ++j) fits = t.size(j + 1) == example[j];
  }
  if (fits) return "";
  std::vector<int64_t> want_shape(example.begin(), example.end());
  return absl::StrCat("activation of microbatch ", id, " has shape ", ShapeText(t.sizes()),
                      " but this stage takes [B, ", absl::StrJoin(want_shape, ", "),
                      "] (the input of unit ", assignment_.first_unit(), ")");
}

bool StageHost::OnNonFinite(uint64_t id, const std::string& what, Side side) {
  const int stage = assignment_.stage();
  const int64_t step = runtime_->Stats().steps;
  if (!skip_nonfinite_) {
    Fail(absl::StrCat(
             "stage ", stage, " (", self_address_, "): NaN or Inf in the ", what, " of microbatch ",
             id, side == Side::kNone ? " it computed" : " from its " + SideName(side), ", at step ",
             step, " (train.on_nonfinite: fail; set it to skip to drop such microbatches)"),
         Side::kNone, absl::StatusCode::kFailedPrecondition);
    return false;
  }
  nonfinite_skipped_.fetch_add(1);
  metrics_->nonfinite_skipped->Increment();
  LogWarning(
      ForStage(assignment_.job_id(), stage),
      absl::StrCat("skipped microbatch ", id, " at step ", step, ": NaN or Inf in its ", what,
                   side == Side::kNone ? " it computed" : " from its " + SideName(side),
                   " (train.on_nonfinite: skip)"));
  return true;
}

void StageHost::OnStreamEnd(Side side, const grpc::Status& status) {
  if (stopping_ || failed_) return;
  Fail(absl::StrCat("stage ", assignment_.stage(), " (", self_address_, "): lost its ",
                    SideName(side), status.ok() ? "" : absl::StrCat(": ", status.error_message())),
       side);
}

bool StageHost::NextEvent(Event* event) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool last = runtime_->is_last();
  auto ready_activation = [&]() -> std::deque<Event>::iterator {
    for (auto it = activations_.begin(); it != activations_.end(); ++it) {
      if (!last || targets_.count(it->microbatch)) return it;
    }
    return activations_.end();
  };
  while (!stopping_ && !failed_) {  // a failed stage computes nothing more
    if (cut_request_ > 0) {
      *event = Event{};
      event->cut = true;
      event->step = cut_request_;
      return true;
    }
    auto act = ready_activation();
    const bool have_act = act != activations_.end();
    // Exactly the input the plan's next action needs; between epochs,
    // evaluation on the drained pipeline or the next epoch's first forward.
    const StageExecutor::Next next = executor_->Peek();
    if (next.action.op == Action::Op::kForward && have_act &&
        (act->phase == v1::TRAIN || executor_->between_epochs())) {
      *event = std::move(*act);
      activations_.erase(act);
      // Room in the inbox: a paused upstream reads on (outside mu_: gRPC
      // may run the next reaction in this thread).
      const bool resume = upstream_paused_ && activations_.size() < inbox_capacity_;
      if (resume) upstream_paused_ = false;
      std::shared_ptr<PipeStream> upstream = link_[static_cast<int>(Side::kUpstream)];
      lock.unlock();
      if (resume && upstream) upstream->ResumeReading();
      return true;
    }
    if (next.action.op == Action::Op::kBackward) {
      for (auto it = gradients_.begin(); it != gradients_.end(); ++it) {
        if (it->microbatch == next.microbatch) {
          *event = std::move(*it);
          gradients_.erase(it);
          return true;
        }
      }
    }
    cv_.wait_for(lock, std::chrono::milliseconds(200));
  }
  return false;
}

void StageHost::QueueCut(std::shared_ptr<const StageSnapshot> snapshot) {
  metrics_->checkpoint_snapshot_seconds->Observe(snapshot->seconds);
  {
    // Each queued cut is a copy of the stage's state in host memory: when
    // the writer falls behind (a slow shared volume), the stage waits for
    // it rather than piling up copies.
    std::unique_lock<std::mutex> lock(checkpoint_mu_);
    checkpoint_cv_.wait(lock, [&] {
      return checkpoint_queue_.size() < kMaxQueuedCuts || checkpoint_stop_ || stopping_;
    });
    checkpoint_queue_.push_back(std::move(snapshot));
  }
  checkpoint_cv_.notify_all();
}

absl::Status StageHost::CutAt(int64_t step) {
  std::unique_lock<std::mutex> lock(mu_);
  if (cut_request_ > 0) return absl::FailedPreconditionError("a cut is already being taken");
  cut_request_ = step;
  cut_error_.clear();
  cv_.notify_all();
  // The compute thread takes it between two actions.
  const bool done = cv_.wait_for(lock, std::chrono::seconds(30),
                                 [&] { return cut_request_ == 0 || stopping_ || failed_; });
  if (!done || cut_request_ != 0) {
    cut_request_ = 0;
    return absl::UnavailableError(failed_ ? absl::StrCat("the stage failed: ", error_)
                                          : "the stage stopped before its cut");
  }
  if (!cut_error_.empty()) return absl::FailedPreconditionError(cut_error_);
  return absl::OkStatus();
}

void StageHost::ComputeLoop() {
  NameThisThread("stage-compute");
  // OpenMP's thread count is per thread: without this, a new thread runs
  // LibTorch's and OpenBLAS's parallel regions with one OpenMP thread per
  // core, whatever --threads says, and the idle ones spin after every region
  // (measured: 62% of all CPU time in libgomp with 8 workers on 2 cores, and
  // a first epoch 6x slower than the next).
  at::init_num_threads();
  if (auto st = ConnectDataPlane(); !st.ok()) {
    if (!stopping_) {
      Fail(absl::StrCat("stage ", assignment_.stage(), " (", self_address_, "): ", st.message()));
    }
    return;
  }
  Event event;
  while (!stopping_ && !failed_) {
    auto waiting = std::chrono::steady_clock::now();
    const bool got = NextEvent(&event);
    metrics_->idle_seconds->Increment(SecondsSince(waiting));
    if (!got) break;
    auto busy = std::chrono::steady_clock::now();
    absl::Status st;
    // The stage's error boundary: the runtime turns LibTorch's exceptions
    // into statuses, and whatever else throws here (a codec, an
    // allocation) still becomes a stage error, never std::terminate.
    try {
      st = Arrive(&event);
      if (st.ok()) st = Process(event);
    } catch (const c10::Error& e) {
      st = absl::InternalError(e.what_without_backtrace());
    } catch (const std::exception& e) {
      st = absl::InternalError(e.what());
    }
    metrics_->busy_seconds->Increment(SecondsSince(busy));
    metrics_->Update(runtime_->Stats());
    if (!st.ok()) {
      Fail(absl::StrCat("stage ", assignment_.stage(), " (", self_address_, "): ", st.message()));
      return;
    }
  }
}

absl::Status StageHost::ConnectDataPlane() {
  // Both edges at once. One after the other, a stage's downstream pair
  // waited for its upstream one, so a pipeline's pairs connected in a
  // chain, stage after stage, while the first microbatches waited.
  std::atomic<bool> given_up{false};
  auto connect = [&](Side side) -> absl::Status {
    DataPlaneEdge* edge = edge_[static_cast<int>(side)].get();
    if (edge == nullptr) return absl::OkStatus();
    {
      // The upstream stream arrives when the stage above starts.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock,
               [&] { return stopping_ || failed_ || given_up || link_[static_cast<int>(side)]; });
      if (stopping_ || failed_ || given_up) return absl::CancelledError("the stage stops");
    }
    const auto start = std::chrono::steady_clock::now();
    absl::Status st = edge->Connect();
    if (!st.ok()) return st;
    LogInfo(ForStage(assignment_.job_id(), assignment_.stage()),
            absl::StrCat("data plane (", assignment_.schedule().transport(), ") to the ",
                         SideName(side), " connected in ", SecondsSince(start), " s"));
    return st;
  };
  // The first failure stops the other side's wait at once.
  auto give_up = [&](Side other, const absl::Status& why) {
    if (why.ok()) return;
    given_up = true;
    if (DataPlaneEdge* edge = edge_[static_cast<int>(other)].get()) {
      edge->Abort(std::string(why.message()));
    }
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

absl::StatusOr<torch::Tensor> StageHost::ReceiveTensor(
    Side side, const PipeMessage& message, std::shared_ptr<DataPlaneEdge::Receive>* arriving) {
  const v1::Tensor* header = PayloadTensor(message.message);
  if (header == nullptr || header->data_plane_bytes() == 0) return FromWire(message, ReceiveAs());
  DataPlaneEdge* edge = side == Side::kUpstream || side == Side::kDownstream
                            ? edge_[static_cast<int>(side)].get()
                            : nullptr;
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

absl::Status StageHost::Arrive(Event* event) {
  if (!event->arriving) return absl::OkStatus();
  if (auto st = edge_[static_cast<int>(event->from)]->Wait(*event->arriving); !st.ok()) return st;
  event->arriving.reset();
  const auto as = ReceiveAs();
  if (as && event->tensor.is_floating_point() && event->tensor.scalar_type() != *as) {
    event->tensor = event->tensor.to(*as);
  }
  const char* what = event->gradient ? "gradient" : "activation";
  if (!event->skipped && !AllFinite(event->tensor)) {
    if (!OnNonFinite(event->microbatch, what, event->from)) {
      return absl::FailedPreconditionError(absl::StrCat("non-finite ", what));
    }
    event->skipped = true;
  }
  if (event->skipped) event->tensor = torch::zeros_like(event->tensor);
  return absl::OkStatus();
}

absl::Status StageHost::Process(const Event& event) {
  if (event.cut) {
    // Not a stage error when refused: the coordinator hears why.
    auto snapshot = executor_->CutAt(event.step);
    if (snapshot.ok() && *snapshot) QueueCut(*snapshot);
    std::lock_guard<std::mutex> lock(mu_);
    cut_error_ = snapshot.ok() ? "" : std::string(snapshot.status().message());
    cut_request_ = 0;
    cv_.notify_all();
    return absl::OkStatus();
  }
  if (event.gradient) return HandleGradient(event);
  return HandleActivation(event);
}

absl::Status StageHost::HandleActivation(const Event& event) {
  const bool train = event.phase != v1::EVAL;
  torch::Tensor targets;
  if (runtime_->is_last()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = targets_.find(event.microbatch);
    targets = it->second;
    targets_.erase(it);
  }
  auto out = train ? executor_->Forward(event.microbatch, event.tensor, targets)
                   : executor_->Evaluate(event.microbatch, event.tensor, targets);
  if (!out.ok()) return out.status();
  bool skipped = event.skipped;
  if (out->loss && !skipped && !std::isfinite(out->loss->loss)) {
    // The last stage's own loss: where a NaN it computed first shows.
    if (!OnNonFinite(event.microbatch, "loss", Side::kNone)) {
      return absl::FailedPreconditionError("non-finite loss");
    }
    skipped = true;
  }
  // A dropped microbatch: no weight here learns from it (its backward
  // passes zeros up), and every later stage and the coordinator know.
  if (skipped && train) {
    if (auto st = runtime_->Drop(event.microbatch); !st.ok()) return st;
  }
  if (auto st = Emit(*out, event.phase, skipped); !st.ok()) return st;
  // Last stage: the backwards the plan puts next (1F1B: this one; gpipe:
  // the step's N after its N-th forward) need no input from anyone.
  return train ? RunLocal() : absl::OkStatus();
}

absl::Status StageHost::RunLocal() {
  for (;;) {
    auto out = executor_->RunLocal();
    if (!out.ok()) return out.status();
    if (!out->has_value()) return absl::OkStatus();
    if (auto st = Emit(**out, v1::TRAIN); !st.ok()) return st;
  }
}

absl::Status StageHost::HandleGradient(const Event& event) {
  if (runtime_->is_last()) return absl::InvalidArgumentError("the last stage got a gradient");
  if (event.skipped) {
    if (auto st = runtime_->Drop(event.microbatch); !st.ok()) return st;
  }
  auto out = executor_->Backward(event.microbatch, event.tensor);
  if (!out.ok()) return out.status();
  if (auto st = Emit(*out, v1::TRAIN); !st.ok()) return st;
  return RunLocal();  // the U that follows every N-th backward
}

absl::Status StageHost::Emit(const StageExecutor::Output& out, v1::Phase phase, bool skipped) {
  v1::StageMessage msg;
  msg.set_microbatch(out.microbatch);
  msg.set_phase(phase);
  msg.set_skipped(skipped);
  switch (out.action.op) {
    case Action::Op::kUpdate:
      metrics_->Update(runtime_->Stats());  // observes the optimizer step
      if (out.snapshot) QueueCut(out.snapshot);
      return absl::OkStatus();
    case Action::Op::kBackward:
      metrics_->backward_seconds->Observe(out.seconds);
      metrics_->backwards->Increment();
      if (runtime_->is_first()) {
        msg.mutable_done();
        return Send(Side::kUpstream, msg);
      } else {
        auto wire = ToWire(out.tensor, wire_dtype_);
        if (!wire.ok()) return wire.status();
        *msg.mutable_gradient() = std::move(wire->header);
        metrics_->sent_gradient_bytes->Increment(wire->payload.size);
        return Send(Side::kUpstream, msg, std::move(wire->payload));
      }
    case Action::Op::kForward:
      (phase == v1::EVAL ? metrics_->forward_eval_seconds : metrics_->forward_train_seconds)
          ->Observe(out.seconds);
      (phase == v1::EVAL ? metrics_->forwards_eval : metrics_->forwards_train)->Increment();
      if (out.loss) {
        msg.mutable_result()->set_loss(out.loss->loss);
        msg.mutable_result()->set_correct(out.loss->correct);
        msg.mutable_result()->set_count(out.loss->count);
        msg.mutable_result()->set_predictions(out.loss->predictions);
        return Send(Side::kTargets, msg);
      }
      auto wire = ToWire(out.tensor, wire_dtype_);
      if (!wire.ok()) return wire.status();
      if (phase == v1::TRAIN) {
        // Before it can arrive: its gradient is then expected.
        std::lock_guard<std::mutex> lock(mu_);
        awaiting_gradient_[out.microbatch] =
            std::vector<int64_t>(out.tensor.sizes().begin(), out.tensor.sizes().end());
        last_sent_ = std::max(last_sent_, out.microbatch);
      }
      *msg.mutable_activation() = std::move(wire->header);
      metrics_->sent_activation_bytes->Increment(wire->payload.size);
      return Send(Side::kDownstream, msg, std::move(wire->payload));
  }
  return absl::OkStatus();
}

std::shared_ptr<PipeStream> StageHost::Link(Side side) const {
  std::lock_guard<std::mutex> lock(mu_);
  return link_[static_cast<int>(side)];
}

absl::Status StageHost::Send(Side side, v1::StageMessage message, WirePayload payload) {
  std::shared_ptr<PipeStream> link = Link(side);
  if (link == nullptr) return absl::FailedPreconditionError(absl::StrCat("no ", SideName(side)));
  DataPlaneEdge* edge = edge_[static_cast<int>(side)].get();
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

std::string StageHost::SideName(Side side) const {
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

void StageHost::Fail(const std::string& message, Side from, absl::StatusCode code) {
  if (failed_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = message;
  }
  LogError(ForStage(assignment_.job_id(), assignment_.stage()),
           absl::StrCat("stage failed: ", message));
  for (auto& edge : edge_) {
    if (edge) edge->Abort(message);
  }
  v1::StageMessage msg;
  msg.mutable_error()->set_message(message);
  msg.mutable_error()->set_code(static_cast<int>(code));
  for (Side side : {Side::kUpstream, Side::kDownstream, Side::kTargets}) {
    if (side == from) continue;
    // Ahead of anything queued, and nothing more after it.
    if (auto link = Link(side)) link->SendLast(EncodePipeMessage(msg));
  }
  cv_.notify_all();
}

v1::StageStatusResponse StageHost::Status() const {
  StageStats s = runtime_->Stats();
  v1::StageStatusResponse r;
  r.set_job_id(assignment_.job_id());
  r.set_stage(assignment_.stage());
  r.set_steps(s.steps);
  r.set_forwards(s.forwards);
  r.set_backwards(s.backwards);
  r.set_measured_delay(s.measured_delay);
  r.set_learning_rate(s.learning_rate);
  auto to_proto = [](const StageMemory& m, v1::StageMemory* out) {
    out->set_weights(m.weights);
    out->set_optimizer_state(m.optimizer_state);
    out->set_t2_velocity(m.t2_velocity);
    out->set_stash(m.stash);
    out->set_saved_activations(m.saved_activations);
  };
  to_proto(s.memory, r.mutable_memory());
  to_proto(s.peak_memory, r.mutable_peak_memory());
  r.set_async_from_step(s.async_from_step);
  r.set_nonfinite_skipped(nonfinite_skipped_.load());
  {
    std::lock_guard<std::mutex> lock(checkpoint_mu_);
    *r.mutable_checkpoint() = checkpoint_written_;
    for (const RetainedCut& cut : retained_) {
      v1::CheckpointWritten* held = r.add_held();
      held->set_step(cut.snapshot->step);
      held->set_generation(cut.snapshot->generation);
      AddFiles(cut.files, held);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  r.set_error(error_);
  return r;
}

}  // namespace pipemare
