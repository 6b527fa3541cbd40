#include "pipeline/runtime/harness.h"

#include <deque>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/settings.h"

namespace pipemare {

absl::StatusOr<std::unique_ptr<PipelineHarness>> PipelineHarness::Create(const v1::JobSpec& spec,
                                                                         int64_t steps_per_epoch,
                                                                         torch::Dtype dtype) {
  auto assignments = ResolveStageAssignments(spec, "harness", steps_per_epoch);
  if (!assignments.ok()) return assignments.status();
  std::unique_ptr<PipelineHarness> h(new PipelineHarness());
  for (const auto& a : *assignments) {
    auto runtime = StageRuntime::Create(a, torch::kCPU, dtype);
    if (!runtime.ok()) {
      return absl::Status(runtime.status().code(),
                          absl::StrCat("stage ", a.stage(), ": ", runtime.status().message()));
    }
    auto machine = StageMachine::Create(a, runtime->get(), {});
    if (!machine.ok()) return machine.status();
    h->runtimes_.push_back(std::move(*runtime));
    h->machines_.push_back(std::move(*machine));
  }
  h->assignments_ = std::move(*assignments);
  return h;
}

absl::StatusOr<std::vector<double>> PipelineHarness::TrainEpoch(
    const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
    const std::function<void(const Action&)>& after_action) {
  const v1::StageAssignment& a0 = assignments_.front();
  const int P = stages();
  // A whole epoch, or the rest of one after a restored cut.
  const int64_t steps =
      a0.steps_per_epoch() - runtimes_.front()->Stats().steps % a0.steps_per_epoch();
  const size_t M = static_cast<size_t>(steps * a0.schedule().microbatches_per_step());
  if (inputs.size() != M || targets.size() != M) {
    return absl::InvalidArgumentError(absl::StrCat("an epoch takes ", M, " microbatches; got ",
                                                   inputs.size(), " inputs and ", targets.size(),
                                                   " targets"));
  }
  // Microbatch ids are unique across epochs; plan index k is id base_id + k - 1.
  const uint64_t base_id = next_id_;
  next_id_ += M;
  auto index_of = [&](uint64_t id) { return static_cast<size_t>(id - base_id); };
  // What crosses the wire between the stages (stage 0 takes its feed's).
  const v1::DType peer_dtype = PeerDType(WireDtypeOf(a0.schedule().wire_dtype()));
  std::vector<double> losses(M, 0);
  std::vector<size_t> forwards(P, 0);  // training forwards each stage has run this epoch
  size_t fed = 0;                      // microbatches fed to stage 0
  auto stage_error = [](int i, const absl::Status& st) {
    return absl::Status(st.code(), absl::StrCat("stage ", i, ": ", st.message()));
  };
  // The last stage's targets go in just before their activation.
  auto offer_targets = [&](uint64_t id) {
    StageMachine::Input t;
    t.kind = StageMachine::Kind::kTargets;
    t.microbatch = id;
    t.tensor = targets[index_of(id)];
    return machines_.back()->Offer(std::move(t));
  };
  auto offer_activation = [&](int i, uint64_t id, torch::Tensor x, bool skipped) {
    if (i + 1 == P) {
      if (auto st = offer_targets(id); !st.ok()) return st;
    }
    StageMachine::Input in;
    in.microbatch = id;
    in.dtype = i > 0 ? peer_dtype : assignments_[0].token_input() ? v1::INT64 : v1::FLOAT32;
    in.tensor = std::move(x);
    in.skipped = skipped;
    return machines_[i]->Offer(std::move(in));
  };
  for (bool progress = true; progress;) {
    progress = false;
    // Stage 0's feed: the next microbatch once it took the last one.
    if (fed < M && forwards[0] == fed) {
      if (auto st = offer_activation(0, base_id + fed, inputs[fed], false); !st.ok()) {
        return stage_error(0, st);
      }
      ++fed;
      progress = true;
    }
    for (int i = 0; i < P; ++i) {
      absl::Status handed;  // a hand-off the next stage refused
      auto emit = [&, i](const StageExecutor::Output& out, v1::Phase, bool skipped) {
        if (out.loss) losses[index_of(out.microbatch)] = out.loss->loss;
        if (out.snapshot) cuts_[out.snapshot->step].push_back(out.snapshot);
        if (out.action.op == Action::Op::kForward) {
          ++forwards[i];
          if (i + 1 < P) {
            handed = offer_activation(i + 1, out.microbatch, out.tensor, skipped);
            if (!handed.ok()) handed = stage_error(i + 1, handed);
          }
        }
        if (out.action.op == Action::Op::kBackward && i > 0) {
          StageMachine::Input g;
          g.kind = StageMachine::Kind::kGradient;
          g.microbatch = out.microbatch;
          g.dtype = peer_dtype;
          g.tensor = out.tensor;
          handed = machines_[i - 1]->Offer(std::move(g));
          if (!handed.ok()) handed = stage_error(i - 1, handed);
        }
        if (after_action) after_action(out.action);
        return handed.ok() ? absl::OkStatus() : absl::AbortedError("hand-off refused");
      };
      while (auto in = machines_[i]->Next(std::chrono::milliseconds(0))) {
        if (auto st = machines_[i]->Run(std::move(*in), emit); !st.ok()) {
          return handed.ok() ? stage_error(i, st) : handed;
        }
        progress = true;
      }
    }
  }
  for (int i = 0; i < P; ++i) {
    const StageExecutor& ex = machines_[i]->executor();
    if (!ex.between_epochs() || forwards[i] != M) {
      return absl::InternalError(
          absl::StrCat("stage ", i, " stalled at ", FormatAction(ex.Peek().action)));
    }
  }
  return losses;
}

absl::Status PipelineHarness::RequestCut(int64_t step) {
  for (int i = 0; i < stages(); ++i) {
    if (auto st = machines_[i]->RequestCut(step); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("stage ", i, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

std::vector<UnitState> PipelineHarness::Cut(int64_t step) const {
  std::vector<UnitState> units;
  auto it = cuts_.find(step);
  if (it == cuts_.end()) return units;
  for (const auto& snapshot : it->second) {
    units.insert(units.end(), snapshot->units.begin(), snapshot->units.end());
  }
  return units;
}

}  // namespace pipemare
