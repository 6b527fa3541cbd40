#include "stage_worker/stage_host.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc.h"
#include "pipeline/torch_codec.h"

namespace pipemare {
namespace {

constexpr double kConnectSeconds = 10;

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

StageHost::StageHost(const v1::StageAssignment& a, const std::string& self_address)
    : assignment_(a), self_address_(self_address) {}

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
    if (auto st = host->runtime_->Restore(units, a.start_step()); !st.ok()) return st;
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
  for (Side side : {Side::kUpstream, Side::kDownstream, Side::kTargets}) {
    StageHost* h = host.get();
    host->outbox_[static_cast<int>(side)] = std::make_unique<Outbox>(
        window, [h, side](const v1::StageMessage& m) { return h->WriteNow(side, m); },
        [h, side] {
          h->Fail(absl::StrCat("stage ", h->assignment_.stage(), " (", h->self_address_,
                               "): lost its ", h->SideName(side), " while sending"),
                  side);
        });
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
    host->downstream_stub_ = v1::StageWorker::NewStub(channel);
    host->downstream_ = host->downstream_stub_->Pipe(&host->downstream_context_);
    v1::StageMessage open;
    open.mutable_open()->set_job_id(a.job_id());
    open.mutable_open()->set_role(v1::StreamOpen::PEER);
    open.mutable_open()->set_from_stage(a.stage());
    open.mutable_open()->set_generation(a.generation());
    if (!host->downstream_->Write(open)) {
      return absl::UnavailableError(absl::StrCat("downstream stage ", a.stage() + 1, " at ",
                                                 a.downstream_address(),
                                                 " closed the stream on open"));
    }
    host->downstream_reader_ = std::thread([h = host.get()] { h->DownstreamReadLoop(); });
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (upstream_context_) upstream_context_->TryCancel();
    if (targets_context_) targets_context_->TryCancel();
  }
  cv_.notify_all();
  {
    std::lock_guard<std::mutex> lock(checkpoint_mu_);  // no lost wake-up in QueueCut
  }
  checkpoint_cv_.notify_all();
  if (downstream_) downstream_context_.TryCancel();
  for (auto& outbox : outbox_) {
    if (outbox) outbox->Close();
  }
  if (compute_thread_.joinable() && compute_thread_.get_id() != std::this_thread::get_id()) {
    compute_thread_.join();
  }
  if (downstream_reader_.joinable() && downstream_reader_.get_id() != std::this_thread::get_id()) {
    downstream_reader_.join();
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

grpc::Status StageHost::Serve(grpc::ServerContext* context, PipeStream* stream,
                              const v1::StreamOpen& open) {
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    PipeStream*& slot = side == Side::kTargets ? targets_stream_ : upstream_;
    if (slot != nullptr) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          "this stage already has that stream attached");
    }
    if (stopping_) return grpc::Status(grpc::StatusCode::CANCELLED, "stage is stopping");
    slot = stream;
    (side == Side::kTargets ? targets_context_ : upstream_context_) = context;
  }
  v1::StageMessage msg;
  std::string why;
  while (!stopping_ && stream->Read(&msg)) {
    if (msg.has_error()) {
      Fail(msg.error().message(), side);
      break;
    }
    if (side == Side::kTargets) {
      if (!msg.has_targets()) {
        why = "the target feed may only carry targets";
        break;
      }
      auto t = TakeTorch(msg.mutable_targets());
      if (!t.ok()) {
        why = absl::StrCat("targets of microbatch ", msg.microbatch(), ": ", t.status().message());
        break;
      }
      metrics_->received_targets_bytes->Increment(t->nbytes());
      std::lock_guard<std::mutex> lock(mu_);
      targets_[msg.microbatch()] = *t;
    } else {
      if (!msg.has_activation()) {
        why = "an upstream stream may only carry activations";
        break;
      }
      const int64_t bytes = msg.activation().data().size();
      // Stage 0's input feed is float32 already; peers may send a wire dtype.
      auto t = TakeTorch(msg.mutable_activation(), ReceiveAs());
      if (!t.ok()) {
        why =
            absl::StrCat("activation of microbatch ", msg.microbatch(), ": ", t.status().message());
        break;
      }
      metrics_->received_activation_bytes->Increment(bytes);
      std::unique_lock<std::mutex> lock(mu_);
      // A full inbox stops reading: backpressure on the sender.
      cv_.wait(lock, [&] { return stopping_ || failed_ || activations_.size() < inbox_capacity_; });
      activations_.push_back(Event{false, msg.microbatch(), msg.phase(), *t});
    }
    cv_.notify_all();
  }
  if (!why.empty()) {
    Fail(absl::StrCat("stage ", stage, " (", self_address_, "): bad message: ", why), side);
  } else if (!stopping_ && !failed_) {
    Fail(absl::StrCat("stage ", stage, " (", self_address_, "): lost its ", SideName(side)), side);
  }
  {
    std::lock_guard<std::mutex> write_lock(write_mu_[static_cast<int>(side)]);
    std::lock_guard<std::mutex> lock(mu_);
    if (side == Side::kTargets) {
      targets_stream_ = nullptr;
      targets_context_ = nullptr;
    } else {
      upstream_ = nullptr;
      upstream_context_ = nullptr;
    }
  }
  cv_.notify_all();
  if (!why.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why);
  return grpc::Status::OK;
}

void StageHost::DownstreamReadLoop() {
  v1::StageMessage msg;
  while (downstream_->Read(&msg)) {
    if (msg.has_error()) {
      Fail(msg.error().message(), Side::kDownstream);
      break;
    }
    if (!msg.has_gradient()) {
      Fail(absl::StrCat("stage ", assignment_.stage(),
                        ": downstream sent something that is not a gradient"),
           Side::kDownstream);
      break;
    }
    const int64_t bytes = msg.gradient().data().size();
    auto t = TakeTorch(msg.mutable_gradient(), ReceiveAs());
    if (!t.ok()) {
      Fail(absl::StrCat("stage ", assignment_.stage(), ": gradient of microbatch ",
                        msg.microbatch(), ": ", t.status().message()));
      break;
    }
    metrics_->received_gradient_bytes->Increment(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      gradients_.push_back(Event{true, msg.microbatch(), v1::TRAIN, *t});
    }
    cv_.notify_all();
  }
  if (!stopping_ && !failed_) {
    grpc::Status st = downstream_->Finish();
    Fail(absl::StrCat("stage ", assignment_.stage(), " (", self_address_, "): lost its ",
                      SideName(Side::kDownstream),
                      st.ok() ? "" : absl::StrCat(": ", st.error_message())),
         Side::kDownstream);
  }
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
      cv_.notify_all();  // room in the inbox
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
  // OpenMP's thread count is per thread: without this, a new thread runs
  // LibTorch's and OpenBLAS's parallel regions with one OpenMP thread per
  // core, whatever --threads says, and the idle ones spin after every region
  // (measured: 62% of all CPU time in libgomp with 8 workers on 2 cores, and
  // a first epoch 6x slower than the next).
  at::init_num_threads();
  Event event;
  while (!stopping_ && !failed_) {
    auto waiting = std::chrono::steady_clock::now();
    const bool got = NextEvent(&event);
    metrics_->idle_seconds->Increment(SecondsSince(waiting));
    if (!got) break;
    auto busy = std::chrono::steady_clock::now();
    absl::Status st = Process(event);
    metrics_->busy_seconds->Increment(SecondsSince(busy));
    metrics_->Update(runtime_->Stats());
    if (!st.ok()) {
      Fail(absl::StrCat("stage ", assignment_.stage(), " (", self_address_, "): ", st.message()));
      return;
    }
  }
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
  if (auto st = Emit(*out, event.phase); !st.ok()) return st;
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
  auto out = executor_->Backward(event.microbatch, event.tensor);
  if (!out.ok()) return out.status();
  if (auto st = Emit(*out, v1::TRAIN); !st.ok()) return st;
  return RunLocal();  // the U that follows every N-th backward
}

absl::Status StageHost::Emit(const StageExecutor::Output& out, v1::Phase phase) {
  v1::StageMessage msg;
  msg.set_microbatch(out.microbatch);
  msg.set_phase(phase);
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
      } else {
        auto wire = FromTorch(out.tensor, wire_dtype_);
        if (!wire.ok()) return wire.status();
        *msg.mutable_gradient() = std::move(*wire);
        metrics_->sent_gradient_bytes->Increment(msg.gradient().data().size());
      }
      return Send(Side::kUpstream, std::move(msg));
    case Action::Op::kForward:
      (phase == v1::EVAL ? metrics_->forward_eval_seconds : metrics_->forward_train_seconds)
          ->Observe(out.seconds);
      (phase == v1::EVAL ? metrics_->forwards_eval : metrics_->forwards_train)->Increment();
      if (out.loss) {
        msg.mutable_result()->set_loss(out.loss->loss);
        msg.mutable_result()->set_correct(out.loss->correct);
        msg.mutable_result()->set_count(out.loss->count);
        msg.mutable_result()->set_predictions(out.loss->predictions);
        return Send(Side::kTargets, std::move(msg));
      }
      auto wire = FromTorch(out.tensor, wire_dtype_);
      if (!wire.ok()) return wire.status();
      *msg.mutable_activation() = std::move(*wire);
      metrics_->sent_activation_bytes->Increment(msg.activation().data().size());
      return Send(Side::kDownstream, std::move(msg));
  }
  return absl::OkStatus();
}

absl::Status StageHost::Send(Side side, v1::StageMessage message) {
  if (side == Side::kDownstream && !downstream_) {
    return absl::FailedPreconditionError("no downstream stage");
  }
  if (!outbox_[static_cast<int>(side)]->Push(std::move(message))) {
    // The outbox's thread has reported the broken stream (or we stop).
    return absl::UnavailableError(absl::StrCat("lost its ", SideName(side)));
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

bool StageHost::WriteNow(Side side, const v1::StageMessage& message) {
  std::lock_guard<std::mutex> write_lock(write_mu_[static_cast<int>(side)]);
  if (side == Side::kDownstream) return downstream_ && downstream_->Write(message);
  PipeStream* stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stream = side == Side::kTargets ? targets_stream_ : upstream_;
  }
  // The handler that owns `stream` unregisters it under this side's lock, so
  // it stays valid while we hold it.
  return stream != nullptr && stream->Write(message);
}

void StageHost::Fail(const std::string& message, Side from) {
  if (failed_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = message;
  }
  LogError(ForStage(assignment_.job_id(), assignment_.stage()),
           absl::StrCat("stage failed: ", message));
  v1::StageMessage msg;
  msg.mutable_error()->set_message(message);
  for (Side side : {Side::kUpstream, Side::kDownstream, Side::kTargets}) {
    if (side == from) continue;
    if (side == Side::kDownstream && !downstream_) continue;
    WriteNow(side, msg);
  }
  for (auto& outbox : outbox_) {
    if (outbox) outbox->Close();  // nothing more after the error
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
