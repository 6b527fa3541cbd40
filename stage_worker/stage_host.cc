#include "stage_worker/stage_host.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/thread_name.h"
#include "stage_worker/replica_cuts.h"
#include "stage_worker/tensor_wire.h"

namespace pipemare {
namespace {

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
  std::shared_ptr<StageSnapshot> restored;
  std::vector<WrittenFile> restored_files;
  if (a.restore_size() > 0 || a.start_step() > 0) {
    // Resume: this stage's units from a checkpoint cut (any partition's).
    // A unit this worker itself wrote to that very file (same path, same
    // SHA-256) comes from its memory of the cut, else from the memory of the
    // same stage of another replica: no disk read.
    CutSources from;
    auto units = LoadCutUnits(a, memory, FetchFromReplicas(a), &from);
    if (!units.ok()) return units.status();
    if (a.restore_weights_only() && a.start_step() != 0) {
      return absl::InvalidArgumentError(
          "restore_weights_only: weights alone start at step 0 (start_step must be 0)");
    }
    if (auto st = host->runtime_->Restore(*units, a.start_step(), a.restore_weights_only());
        !st.ok()) {
      return st;
    }
    host->restored_from_memory_ =
        !units->empty() && from.own_memory == static_cast<int>(units->size());
    host->restored_from_replica_ = from.replica > 0 && from.disk == 0;
    host->metrics_->Update(host->runtime_->Stats());
    LogInfo(ForStage(a.job_id(), a.stage()),
            absl::StrCat("restored units [", a.first_unit(), ", ", a.first_unit() + a.units(),
                         ") from the checkpoint at step ", a.start_step(), " (", from.own_memory,
                         " of ", units->size(), " from memory, ", from.replica,
                         " from a replica's memory, ", from.disk, " from disk)"));
    if (!a.restore_weights_only()) {
      // The cut stays in memory, committed: the same stage of another
      // replica restores it from here, and a rollback to it reads no disk.
      restored = std::make_shared<StageSnapshot>();
      restored->step = a.start_step();
      restored->stage = a.stage();
      restored->generation = -1;  // an earlier run's: never this run's to commit
      for (const auto& f : a.restore()) {
        if (f.unit() < a.first_unit() || f.unit() >= a.first_unit() + a.units()) continue;
        restored_files.push_back({f.unit(), f.path(), f.bytes(), f.sha256()});
      }
      restored->units = *std::move(units);
    }
  }
  {
    const auto start = std::chrono::steady_clock::now();
    auto data = StageData::Load(a);
    if (!data.ok()) {
      return absl::Status(data.status().code(), absl::StrCat("data on this worker (", self_address,
                                                             "): ", data.status().message()));
    }
    host->data_ = *std::move(data);
    if (host->data_) {
      const bool first = a.stage() == 0, last = a.stage() + 1 == a.num_stages();
      const char* what = first && last ? "inputs and targets" : first ? "inputs" : "targets";
      LogInfo(ForStage(a.job_id(), a.stage()),
              absl::StrCat("reads its own ", what, ": ", a.data_files_size(),
                           " files match the coordinator's manifest; ", host->data_->bytes() >> 20,
                           " MiB loaded in ", SecondsSince(start), " s"));
    }
  }
  auto replicas = ReplicaGroup::Create(a, self_address);
  if (!replicas.ok()) return replicas.status();
  host->replicas_ = *std::move(replicas);
  if (host->replicas_) {
    ReplicaGroup* group = host->replicas_.get();
    StageMetrics* m = host->metrics_.get();
    host->runtime_->SetGradientReducer([group, m](const std::vector<torch::Tensor>& grads) {
      const double seconds = group->seconds();
      const int64_t bytes = group->bytes();
      group->Average(grads);
      m->allreduce_seconds->Observe(group->seconds() - seconds);
      m->allreduce_bytes->Increment(static_cast<double>(group->bytes() - bytes));
    });
  }
  StageMachine::Options options;
  StageHost* h = host.get();
  options.source_name = [h](int side) { return h->links_->SideName(static_cast<Side>(side)); };
  options.on_skip = [h](const std::string& warning) {
    h->metrics_->nonfinite_skipped->Increment();
    LogWarning(ForStage(h->assignment_.job_id(), h->assignment_.stage()), warning);
  };
  auto machine = StageMachine::Create(a, host->runtime_.get(), std::move(options));
  if (!machine.ok()) return machine.status();
  host->machine_ = std::move(*machine);
  // The machine's bounds on waiting inputs (they only bite on a misbehaving
  // peer) are the streams' too: then they push back.
  host->links_ = std::make_unique<StageLinks>(
      a, self_address, host->metrics_, host->machine_->inbox_capacity(),
      [h](Side side, absl::StatusOr<PipeMessage> m) { return h->OnMessage(side, std::move(m)); },
      [h](Side side, const grpc::Status& st) { h->OnStreamEnd(side, st); });
  if (auto st = host->links_->Open(); !st.ok()) return st;
  host->cuts_ =
      std::make_unique<CutWriter>(a.checkpoint_dir(), a.job_id(), a.stage(), host->metrics_);
  if (restored) host->cuts_->Hold({std::move(restored), std::move(restored_files)});
  host->compute_thread_ = std::thread([h = host.get()] { h->ComputeLoop(); });
  return host;
}

StageHost::~StageHost() { Stop(); }

void StageHost::NoteCommitted(int64_t step) { cuts_->NoteCommitted(step); }

std::vector<RetainedCut> StageHost::Retained() const { return cuts_->Retained(); }

void StageHost::Stop() {
  stopping_ = true;
  if (machine_) machine_->Stop("the stage stopped before its cut");
  if (replicas_) replicas_->Abort();
  if (cuts_) cuts_->Abandon();
  if (links_) {
    links_->Abort("the stage stops");
    // After this no stream calls into the host.
    links_->CloseAndWait();
  }
  if (compute_thread_.joinable() && compute_thread_.get_id() != std::this_thread::get_id()) {
    compute_thread_.join();
  }
  if (cuts_) cuts_->Finish();  // cuts already taken are still written
}

grpc::Status StageHost::Attach(const v1::StreamOpen& open, std::shared_ptr<PipeStream> stream) {
  return links_->Attach(open, std::move(stream));
}

bool StageHost::OnMessage(Side side, absl::StatusOr<PipeMessage> message) {
  std::string why;
  if (!message.ok()) {
    why = std::string(message.status().message());
  } else if (message->message.has_error()) {
    const int code = message->message.error().code();
    Fail(message->message.error().message(), side,
         code == 0 ? absl::StatusCode::kUnavailable : static_cast<absl::StatusCode>(code));
    return false;
  } else if (message->message.has_data_plane_key()) {
    auto st = links_->OnPeerKey(side, message->message.data_plane_key());
    if (st.ok()) return true;
    why = std::string(st.message());
  } else {
    auto input = ToInput(side, *message);
    absl::Status st = input.status();
    if (st.ok()) {
      // A data slice counts as what came: its message.
      const v1::Tensor* payload = PayloadTensor(message->message);
      const double bytes =
          payload == nullptr ? static_cast<double>(message->message.ByteSizeLong())
          : input->kind == StageMachine::Kind::kTargets
              ? static_cast<double>(input->tensor.nbytes())
              : static_cast<double>(message->data_size + payload->data_plane_bytes());
      const StageMachine::Kind kind = input->kind;
      bool full = false;
      st = machine_->Offer(*std::move(input), &full);
      if (st.ok()) {
        (kind == StageMachine::Kind::kTargets    ? metrics_->received_targets_bytes
         : kind == StageMachine::Kind::kGradient ? metrics_->received_gradient_bytes
                                                 : metrics_->received_activation_bytes)
            ->Increment(bytes);
        return !full;  // a full inbox stops reading: backpressure on the sender
      }
      if (absl::IsFailedPrecondition(st)) {  // train.on_nonfinite: fail
        Fail(Labeled(st.message()), Side::kNone, st.code());
        return false;
      }
    }
    why = std::string(st.message());
  }
  Fail(Labeled(absl::StrCat("bad message from its ", links_->SideName(side), ": ", why)), side);
  links_->CloseWith(side, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why));
  return false;
}

absl::StatusOr<StageMachine::Input> StageHost::ToInput(Side side, const PipeMessage& message) {
  const v1::StageMessage& m = message.message;
  StageMachine::Input in;
  in.microbatch = m.microbatch();
  in.source = static_cast<int>(side);
  const char* what = "activation";
  if (m.has_data()) {
    in.kind = side == Side::kTargets ? StageMachine::Kind::kTargets : in.kind;
    in.phase = m.phase();
    auto t = FromSlice(side, m);
    if (!t.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data slice of microbatch ", in.microbatch, ": ", t.status().message()));
    }
    in.dtype = t->scalar_type() == torch::kInt64 ? v1::INT64 : v1::FLOAT32;
    in.tensor = *std::move(t);
    return in;
  }
  if (side == Side::kTargets) {
    if (!m.has_targets())
      return absl::InvalidArgumentError("the target feed may only carry targets or data slices");
    in.kind = StageMachine::Kind::kTargets;
    what = "targets";
  } else if (side == Side::kDownstream) {
    if (!m.has_gradient()) {
      return absl::InvalidArgumentError("downstream sent something that is not a gradient");
    }
    in.kind = StageMachine::Kind::kGradient;
    in.dtype = m.gradient().dtype();
    what = "gradient";
  } else {
    if (!m.has_activation()) {
      return absl::InvalidArgumentError("an upstream stream may only carry activations");
    }
    in.dtype = m.activation().dtype();
    in.phase = m.phase();
    in.skipped = m.skipped();
  }
  std::shared_ptr<void> arriving;
  auto t =
      side == Side::kTargets ? FromWire(message) : links_->ReceiveTensor(side, message, &arriving);
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of microbatch ", in.microbatch, ": ", t.status().message()));
  }
  in.tensor = *std::move(t);
  in.arriving = std::move(arriving);
  return in;
}

absl::StatusOr<torch::Tensor> StageHost::FromSlice(Side side, const v1::StageMessage& m) {
  const bool targets = side == Side::kTargets;
  if (side != Side::kTargets && !(side == Side::kUpstream && assignment_.stage() == 0)) {
    return absl::InvalidArgumentError("only the coordinator's feeds carry data slices");
  }
  if (data_ == nullptr) {
    return absl::InvalidArgumentError(
        "this stage was given no data to read (StageAssignment.data); its feed must carry "
        "tensors");
  }
  auto batch = data_->Make(m.data(), m.phase(), targets);
  if (!batch.ok()) return batch.status();
  auto owned = std::make_shared<Batch>(*std::move(batch));
  const bool floats = !owned->floats.empty();
  void* ptr = floats ? static_cast<void*>(owned->floats.data()) : owned->ints.data();
  return torch::from_blob(
      ptr, owned->shape, [owned](void*) {}, floats ? torch::kFloat32 : torch::kInt64);
}

std::string StageHost::Labeled(absl::string_view message) const {
  return absl::StrCat("stage ", assignment_.stage(), " (", self_address_, "): ", message);
}

void StageHost::OnStreamEnd(Side side, const grpc::Status& status) {
  if (stopping_ || failed_) return;
  if (machine_ && machine_->trained()) {
    // The job's training is over: the coordinator closes the feeds and
    // releases the stages one by one; what is left to it (a worker lost
    // during the last evaluation) it sees by its own heartbeats.
    LogInfo(
        ForStage(assignment_.job_id(), assignment_.stage()),
        Labeled(absl::StrCat(links_->SideName(side), " ended after the job's last step",
                             status.ok() ? "" : absl::StrCat(" (", status.error_message(), ")"))));
    return;
  }
  Fail(Labeled(absl::StrCat("lost its ", links_->SideName(side),
                            status.ok() ? "" : absl::StrCat(": ", status.error_message()))),
       side);
}

absl::Status StageHost::CutAt(int64_t step) {
  if (auto st = machine_->RequestCut(step); !st.ok()) return st;
  // The compute thread takes it between two actions.
  return machine_->AwaitCut(std::chrono::seconds(30));
}

void StageHost::ComputeLoop() {
  NameThisThread("stage-compute");
  // OpenMP's thread count is per thread: without this, a new thread runs
  // LibTorch's and OpenBLAS's parallel regions with one OpenMP thread per
  // core, whatever --threads says, and the idle ones spin after every region
  // (measured: 62% of all CPU time in libgomp with 8 workers on 2 cores, and
  // a first epoch 6x slower than the next).
  at::init_num_threads();
  if (auto st = links_->ConnectDataPlane(); !st.ok()) {
    if (!stopping_) Fail(Labeled(st.message()));
    return;
  }
  if (replicas_) {
    const auto start = std::chrono::steady_clock::now();
    if (auto st = replicas_->Connect(std::chrono::seconds(60)); !st.ok()) {
      if (!stopping_) Fail(Labeled(st.message()));
      return;
    }
    LogInfo(ForStage(assignment_.job_id(), assignment_.stage()),
            absl::StrCat("replica ", assignment_.replica(), " of ", assignment_.replicas(),
                         " joined the stage's all-reduce group (c10d ProcessGroupGloo) in ",
                         SecondsSince(start), " s"));
  }
  const StageMachine::Emit emit = [this](const StageExecutor::Output& out, v1::Phase phase,
                                         bool skipped) { return Emit(out, phase, skipped); };
  while (!stopping_ && !failed_) {
    auto waiting = std::chrono::steady_clock::now();
    bool resume = false;
    std::optional<StageMachine::Input> input =
        machine_->Next(std::chrono::milliseconds(200), &resume);
    // Room in the inbox: a paused upstream reads on.
    if (resume) links_->ResumeReading(Side::kUpstream);
    metrics_->idle_seconds->Increment(SecondsSince(waiting));
    if (!input) continue;
    auto busy = std::chrono::steady_clock::now();
    absl::Status st;
    // The stage's error boundary: the runtime turns LibTorch's exceptions
    // into statuses, and whatever else throws here (a codec, an
    // allocation) still becomes a stage error, never std::terminate.
    try {
      st = Arrive(&*input);
      if (st.ok()) st = machine_->Run(*std::move(input), emit);
    } catch (const c10::Error& e) {
      st = absl::InternalError(e.what_without_backtrace());
    } catch (const std::exception& e) {
      st = absl::InternalError(e.what());
    }
    metrics_->busy_seconds->Increment(SecondsSince(busy));
    metrics_->Update(runtime_->Stats());
    if (!st.ok()) {
      // FAILED_PRECONDITION: a NaN or Inf under train.on_nonfinite: fail
      // (no retry helps); anything else lets recovery restart the job.
      Fail(Labeled(st.message()), Side::kNone,
           absl::IsFailedPrecondition(st) ? st.code() : absl::StatusCode::kUnavailable);
      return;
    }
  }
}

absl::Status StageHost::Arrive(StageMachine::Input* input) {
  if (!input->arriving) return absl::OkStatus();
  auto st = links_->Wait(static_cast<Side>(input->source), input->arriving, &input->tensor);
  input->arriving.reset();
  return st;  // the machine checks its values
}

absl::Status StageHost::Emit(const StageExecutor::Output& out, v1::Phase phase, bool skipped) {
  v1::StageMessage msg;
  msg.set_microbatch(out.microbatch);
  msg.set_phase(phase);
  msg.set_skipped(skipped);
  switch (out.action.op) {
    case Action::Op::kUpdate:               // a step, or a cut asked for (CutAt)
      metrics_->Update(runtime_->Stats());  // observes the optimizer step
      // Checkpoints are replica 0's: the replicas hold the same weights.
      if (out.snapshot && assignment_.replica() == 0) cuts_->Queue(out.snapshot);
      return absl::OkStatus();
    case Action::Op::kWeight:  // zero_bubble's W: nothing to send
      metrics_->weight_seconds->Observe(out.seconds);
      metrics_->weight_gradients->Increment();
      return absl::OkStatus();
    case Action::Op::kBackward:
      metrics_->backward_seconds->Observe(out.seconds);
      metrics_->backwards->Increment();
      if (runtime_->is_first()) {
        msg.mutable_done();
        return links_->Send(Side::kUpstream, msg);
      } else {
        auto wire = ToWire(out.tensor, links_->wire_dtype());
        if (!wire.ok()) return wire.status();
        *msg.mutable_gradient() = std::move(wire->header);
        metrics_->sent_gradient_bytes->Increment(wire->payload.size);
        return links_->Send(Side::kUpstream, msg, std::move(wire->payload));
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
        return links_->Send(Side::kTargets, msg);
      }
      auto wire = ToWire(out.tensor, links_->wire_dtype());
      if (!wire.ok()) return wire.status();
      *msg.mutable_activation() = std::move(wire->header);
      metrics_->sent_activation_bytes->Increment(wire->payload.size);
      return links_->Send(Side::kDownstream, msg, std::move(wire->payload));
  }
  return absl::OkStatus();
}

void StageHost::Fail(const std::string& message, Side from, absl::StatusCode code) {
  if (failed_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    error_ = message;
  }
  if (machine_) machine_->Stop(absl::StrCat("the stage failed: ", message));
  LogError(ForStage(assignment_.job_id(), assignment_.stage()),
           absl::StrCat("stage failed: ", message));
  v1::StageMessage msg;
  msg.mutable_error()->set_message(message);
  msg.mutable_error()->set_code(static_cast<int>(code));
  links_->Abort(message);
  links_->SendLast(from, msg);
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
  r.set_nonfinite_skipped(machine_->nonfinite_skipped());
  if (replicas_) {
    r.set_allreduces(replicas_->allreduces());
    r.set_allreduce_seconds(replicas_->seconds());
    r.set_allreduce_bytes(replicas_->bytes());
  }
  cuts_->Report(&r);
  std::lock_guard<std::mutex> lock(error_mu_);
  r.set_error(error_);
  return r;
}

}  // namespace pipemare
