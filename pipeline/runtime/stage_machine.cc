#include "pipeline/runtime/stage_machine.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipeline/core/settings.h"

namespace pipemare {
namespace {

// Whether every element of `t` is finite. One vectorized pass in the
// common case: a NaN or Inf element makes the sum NaN or Inf, so a finite
// sum proves them all finite; only a non-finite sum (a bad element, or
// finite elements that overflow the sum) takes the exact, masked check.
bool AllFinite(const torch::Tensor& t) {
  if (!t.defined() || !t.is_floating_point() || t.numel() == 0) return true;
  if (std::isfinite(t.sum().item<double>())) return true;
  return torch::isfinite(t).all().item<bool>();
}

std::string ShapeText(c10::IntArrayRef sizes) { return c10::str(sizes); }

const char* What(StageMachine::Kind kind) {
  return kind == StageMachine::Kind::kGradient ? "gradient" : "activation";
}

}  // namespace

StageMachine::StageMachine(const v1::StageAssignment& a, StageRuntime* runtime, Options options)
    : assignment_(a),
      runtime_(runtime),
      options_(std::move(options)),
      last_(runtime->is_last()),
      skip_nonfinite_(OnNonFiniteOf(a.on_nonfinite()) == OnNonFinite::kSkip),
      peer_dtype_(PeerDType(WireDtypeOf(a.schedule().wire_dtype()))),
      inbox_capacity_(
          static_cast<size_t>(std::max(a.num_stages(), 2 * a.schedule().microbatches_per_step())) +
          2) {}

absl::StatusOr<std::unique_ptr<StageMachine>> StageMachine::Create(const v1::StageAssignment& a,
                                                                   StageRuntime* runtime,
                                                                   Options options) {
  auto executor = StageExecutor::Create(a, runtime);
  if (!executor.ok()) return executor.status();
  std::unique_ptr<StageMachine> m(new StageMachine(a, runtime, std::move(options)));
  m->executor_.emplace(std::move(*executor));
  return m;
}

std::string StageMachine::CheckActivation(const Input& in) const {
  const bool feed = assignment_.stage() == 0;
  const v1::DType want = feed && assignment_.token_input() ? v1::INT64
                         : feed                            ? v1::FLOAT32
                                                           : peer_dtype_;
  const uint64_t id = in.microbatch;
  if (in.dtype != want) {
    return absl::StrCat("activation of microbatch ", id, " is ", v1::DType_Name(in.dtype),
                        " but this stage takes ", v1::DType_Name(want),
                        feed ? "" : " (schedule.wire_dtype)");
  }
  const torch::Tensor& t = in.tensor;
  const auto& example = assignment_.input_shape();
  bool fits = t.defined() && t.dim() >= 1 && t.size(0) >= 1;
  if (fits && !example.empty()) {
    fits = t.dim() == example.size() + 1;
    for (int j = 0; fits && j < example.size(); ++j) fits = t.size(j + 1) == example[j];
  }
  if (fits) return "";
  std::vector<int64_t> want_shape(example.begin(), example.end());
  return absl::StrCat("activation of microbatch ", id, " has shape ",
                      t.defined() ? ShapeText(t.sizes()) : "none", " but this stage takes [B, ",
                      absl::StrJoin(want_shape, ", "), "] (the input of unit ",
                      assignment_.first_unit(), ")");
}

absl::Status StageMachine::Offer(Input input, bool* inbox_full) {
  if (inbox_full != nullptr) *inbox_full = false;
  input.checked = false;
  switch (input.kind) {
    case Kind::kActivation:
      return OfferActivation(std::move(input), inbox_full);
    case Kind::kGradient:
      return OfferGradient(std::move(input));
    case Kind::kTargets:
      return OfferTargets(std::move(input));
    case Kind::kCut:
      break;
  }
  return absl::InvalidArgumentError("a cut is asked for with RequestCut, not offered");
}

absl::Status StageMachine::OfferActivation(Input in, bool* inbox_full) {
  const uint64_t id = in.microbatch;
  if (std::string why = CheckActivation(in); !why.empty()) {
    return absl::InvalidArgumentError(why);
  }
  {
    // (One message at a time per source: nothing else moves it.)
    absl::MutexLock lock(&mu_);
    if (id <= last_activation_) {
      return absl::InvalidArgumentError(
          absl::StrCat("activation of microbatch ", id, " arrived after microbatch ",
                       last_activation_, "'s: a duplicate or out-of-order id (ids only increase)"));
    }
    last_activation_ = id;
  }
  if (!in.arriving) {  // else Run checks it, once its bytes are there
    if (auto st = CheckValues(&in); !st.ok()) return st;
  }
  absl::MutexLock lock(&mu_);
  activations_.push_back(std::move(in));
  // A full inbox stops reading: backpressure on the sender.
  if (activations_.size() >= inbox_capacity_) {
    paused_ = true;
    if (inbox_full != nullptr) *inbox_full = true;
  }
  cv_.SignalAll();
  return absl::OkStatus();
}

absl::Status StageMachine::OfferGradient(Input in) {
  const uint64_t id = in.microbatch;
  {
    absl::MutexLock lock(&mu_);
    // Only for a training activation this stage sent and still awaits a
    // gradient for, of the shape it sent; never more gradients than
    // microbatches in flight below this stage (the coordinator's window).
    auto sent = awaiting_gradient_.find(id);
    const v1::DType want = peer_dtype_;
    std::string why;
    if (sent == awaiting_gradient_.end()) {
      why = id > last_sent_ ? absl::StrCat("gradient of microbatch ", id,
                                           ", which this stage never sent downstream")
                            : absl::StrCat("stale gradient of microbatch ", id,
                                           ": its gradient already arrived, or it was not a "
                                           "training microbatch");
    } else if (!in.tensor.defined() || !in.tensor.sizes().equals(sent->second)) {
      why = absl::StrCat("gradient of microbatch ", id, " has shape ",
                         in.tensor.defined() ? ShapeText(in.tensor.sizes()) : "none",
                         " but the activation sent was ", ShapeText(sent->second));
    } else if (in.dtype != want) {
      why = absl::StrCat("gradient of microbatch ", id, " is ", v1::DType_Name(in.dtype), " but ",
                         v1::DType_Name(want), " was sent (schedule.wire_dtype)");
    } else if (gradients_.size() >= inbox_capacity_) {
      why = absl::StrCat("gradient of microbatch ", id, ": more than ", inbox_capacity_,
                         " gradients waiting, more than the pipeline's window allows");
    }
    if (!why.empty()) return absl::InvalidArgumentError(why);
    awaiting_gradient_.erase(sent);
  }
  if (!in.arriving) {
    if (auto st = CheckValues(&in); !st.ok()) return st;
  }
  absl::MutexLock lock(&mu_);
  gradients_.push_back(std::move(in));
  cv_.SignalAll();
  return absl::OkStatus();
}

absl::Status StageMachine::OfferTargets(Input in) {
  const uint64_t id = in.microbatch;
  absl::MutexLock lock(&mu_);
  // The feed sends targets only for microbatches in the window, in
  // increasing id order.
  if (!last_) return absl::InvalidArgumentError("targets go to the last stage only");
  if (targets_.size() >= inbox_capacity_) {
    return absl::InvalidArgumentError(
        absl::StrCat("targets of microbatch ", id, ": more than ", inbox_capacity_,
                     " targets waiting, more than the pipeline's window allows"));
  }
  if (targets_.count(id)) {
    return absl::InvalidArgumentError(absl::StrCat("targets of microbatch ", id, " arrived twice"));
  }
  if (id <= last_targets_) {
    return absl::InvalidArgumentError(absl::StrCat("targets of microbatch ", id,
                                                   " arrived after microbatch ", last_targets_,
                                                   "'s: a stale id (ids only increase)"));
  }
  targets_.emplace(id, std::move(in.tensor));
  last_targets_ = id;
  cv_.SignalAll();
  return absl::OkStatus();
}

absl::Status StageMachine::CheckValues(Input* in) {
  in->checked = true;
  if (!in->skipped && !AllFinite(in->tensor)) {
    if (auto st = OnNonFinite(in->microbatch, What(in->kind), in->source); !st.ok()) return st;
    in->skipped = true;
  }
  if (in->skipped && in->tensor.defined()) in->tensor = torch::zeros_like(in->tensor);
  return absl::OkStatus();
}

absl::Status StageMachine::OnNonFinite(uint64_t id, const std::string& what, int source) {
  const int64_t step = runtime_->Stats().steps;
  const std::string from = source == 0 || !options_.source_name
                               ? " it computed"
                               : " from its " + options_.source_name(source);
  if (!skip_nonfinite_) {
    return absl::FailedPreconditionError(
        absl::StrCat("NaN or Inf in the ", what, " of microbatch ", id, from, ", at step ", step,
                     " (train.on_nonfinite: fail; set it to skip to drop such microbatches)"));
  }
  {
    absl::MutexLock lock(&mu_);
    ++nonfinite_skipped_;
  }
  if (options_.on_skip) {
    options_.on_skip(absl::StrCat("skipped microbatch ", id, " at step ", step,
                                  ": NaN or Inf in its ", what, from,
                                  " (train.on_nonfinite: skip)"));
  }
  return absl::OkStatus();
}

int64_t StageMachine::nonfinite_skipped() const {
  absl::MutexLock lock(&mu_);
  return nonfinite_skipped_;
}

absl::Status StageMachine::RequestCut(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (cut_pending_) return absl::FailedPreconditionError("a cut is already being taken");
  if (stopped_) return absl::UnavailableError(stop_reason_);
  cut_request_ = step;
  cut_pending_ = true;
  cut_error_.clear();
  cv_.SignalAll();
  return absl::OkStatus();
}

absl::Status StageMachine::AwaitCut(std::chrono::milliseconds timeout) {
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  while (cut_pending_ && !stopped_) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  if (cut_pending_) {
    cut_pending_ = false;
    cut_request_ = 0;
    return absl::UnavailableError(
        stopped_ ? stop_reason_
                 : absl::StrCat("the stage took no cut within ",
                                absl::FormatDuration(absl::FromChrono(timeout))));
  }
  if (!cut_error_.empty()) return absl::FailedPreconditionError(cut_error_);
  return absl::OkStatus();
}

void StageMachine::Stop(const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  stopped_ = true;
  stop_reason_ = why;
  cv_.SignalAll();
}

std::optional<StageMachine::Input> StageMachine::Next(std::chrono::milliseconds wait,
                                                      bool* resume) {
  if (resume != nullptr) *resume = false;
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + absl::FromChrono(wait);
  while (!stopped_) {  // a stopped stage computes nothing more
    if (cut_request_ > 0) {
      Input cut;
      cut.kind = Kind::kCut;
      cut.step = cut_request_;
      cut_request_ = 0;
      return cut;
    }
    // Exactly the input the plan's next action needs; between epochs,
    // evaluation on the drained pipeline or the next epoch's first forward.
    // The last stage takes an activation once its targets are there.
    const StageExecutor::Next next = executor_->Peek();
    if (next.action.op == Action::Op::kForward) {
      auto paired = [&](const Input& in) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !last_ || targets_.count(in.microbatch) > 0;
      };
      auto act = std::find_if(activations_.begin(), activations_.end(), paired);
      if (act != activations_.end() && (act->phase == v1::TRAIN || executor_->between_epochs())) {
        Input in = std::move(*act);
        activations_.erase(act);
        // Room in the inbox: a paused source reads on.
        if (paused_ && activations_.size() < inbox_capacity_) {
          paused_ = false;
          if (resume != nullptr) *resume = true;
        }
        return in;
      }
    }
    if (next.action.op == Action::Op::kBackward) {
      for (auto it = gradients_.begin(); it != gradients_.end(); ++it) {
        if (it->microbatch == next.microbatch) {
          Input in = std::move(*it);
          gradients_.erase(it);
          return in;
        }
      }
    }
    if (cv_.WaitWithDeadline(&mu_, deadline)) return std::nullopt;
  }
  return std::nullopt;
}

absl::Status StageMachine::Run(Input input, const Emit& emit) {
  switch (input.kind) {
    case Kind::kCut: {
      // Not a stage error when refused: whoever asked hears why.
      auto snapshot = executor_->CutAt(input.step);
      absl::Status st;
      if (snapshot.ok() && *snapshot) {
        StageExecutor::Output out;
        out.action.stage = assignment_.stage();
        out.action.op = Action::Op::kUpdate;
        out.snapshot = *snapshot;
        st = emit(out, v1::TRAIN, false);
      }
      absl::MutexLock lock(&mu_);
      cut_error_ = snapshot.ok() ? "" : std::string(snapshot.status().message());
      cut_pending_ = false;
      cv_.SignalAll();
      return st;
    }
    case Kind::kActivation:
      return RunActivation(input, emit);
    case Kind::kGradient:
      return RunGradient(input, emit);
    case Kind::kTargets:
      break;
  }
  return absl::InternalError("targets are not an action's input");
}

absl::Status StageMachine::RunActivation(Input& in, const Emit& emit) {
  if (!in.checked) {
    if (auto st = CheckValues(&in); !st.ok()) return st;
  }
  const bool train = in.phase != v1::EVAL;
  torch::Tensor targets;
  if (last_) {
    absl::MutexLock lock(&mu_);
    auto it = targets_.find(in.microbatch);
    if (it == targets_.end()) {
      return absl::InternalError(absl::StrCat("no targets for microbatch ", in.microbatch));
    }
    targets = std::move(it->second);
    targets_.erase(it);
  }
  auto out = train ? executor_->Forward(in.microbatch, in.tensor, targets)
                   : executor_->Evaluate(in.microbatch, in.tensor, targets);
  if (!out.ok()) return out.status();
  bool skipped = in.skipped;
  if (out->loss && !skipped && !std::isfinite(out->loss->loss)) {
    // The last stage's own loss: where a NaN it computed first shows.
    if (auto st = OnNonFinite(in.microbatch, "loss", 0); !st.ok()) return st;
    skipped = true;
  }
  // A dropped microbatch: no weight here learns from it (its backward
  // passes zeros up), and every later stage and the coordinator know.
  if (skipped && train) {
    if (auto st = runtime_->Drop(in.microbatch); !st.ok()) return st;
  }
  if (train && !out->loss) {
    // Before it can arrive: its gradient is then expected.
    absl::MutexLock lock(&mu_);
    awaiting_gradient_[out->microbatch] =
        std::vector<int64_t>(out->tensor.sizes().begin(), out->tensor.sizes().end());
    last_sent_ = std::max(last_sent_, out->microbatch);
  }
  if (auto st = emit(*out, in.phase, skipped); !st.ok()) return st;
  // Last stage: the backwards the plan puts next (1F1B: this one; gpipe:
  // the step's N after its N-th forward) need no input from anyone.
  return train ? RunLocal(emit) : absl::OkStatus();
}

absl::Status StageMachine::RunGradient(Input& in, const Emit& emit) {
  if (last_) return absl::InvalidArgumentError("the last stage got a gradient");
  if (!in.checked) {
    if (auto st = CheckValues(&in); !st.ok()) return st;
  }
  if (in.skipped) {
    if (auto st = runtime_->Drop(in.microbatch); !st.ok()) return st;
  }
  auto out = executor_->Backward(in.microbatch, in.tensor);
  if (!out.ok()) return out.status();
  if (auto st = emit(*out, v1::TRAIN, false); !st.ok()) return st;
  return RunLocal(emit);  // the U that follows every N-th backward
}

absl::Status StageMachine::RunLocal(const Emit& emit) {
  for (;;) {
    auto out = executor_->RunLocal();
    if (!out.ok()) return out.status();
    if (!out->has_value()) {
      if (executor_->trained()) trained_ = true;
      return absl::OkStatus();
    }
    if (auto st = emit(**out, v1::TRAIN, false); !st.ok()) return st;
  }
}

}  // namespace pipemare
