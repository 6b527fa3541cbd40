#include "pipeline/harness.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "pipeline/job_spec.h"

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
    h->runtimes_.push_back(std::move(*runtime));
  }
  h->assignments_ = std::move(*assignments);
  return h;
}

absl::StatusOr<std::vector<double>> PipelineHarness::TrainEpoch(
    const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
    const std::function<void(const Action&)>& after_action) {
  const v1::StageAssignment& a0 = assignments_.front();
  const int P = stages();
  const int64_t first_step = runtimes_.front()->Stats().steps;
  auto plan = BuildPlan({a0.schedule().type(), P, a0.schedule().microbatches_per_step(),
                         a0.steps_per_epoch(), first_step, a0.warmup_steps()});
  if (!plan.ok()) return plan.status();
  if (auto st = ValidatePlan(*plan); !st.ok()) return st;
  const size_t M =
      static_cast<size_t>(a0.steps_per_epoch() * a0.schedule().microbatches_per_step());
  if (inputs.size() != M || targets.size() != M) {
    return absl::InvalidArgumentError(absl::StrCat("an epoch takes ", M, " microbatches; got ",
                                                   inputs.size(), " inputs and ", targets.size(),
                                                   " targets"));
  }
  const uint64_t base_id = next_id_;
  next_id_ += M;
  // The queues: what stage i has received and not yet used, by microbatch.
  std::vector<std::map<int64_t, torch::Tensor>> activations(P), gradients(P);
  std::vector<double> losses(M, 0);
  std::vector<size_t> next(P, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int i = 0; i < P; ++i) {
      StageRuntime& rt = *runtimes_[i];
      const auto& actions = plan->actions[i];
      while (next[i] < actions.size()) {
        const Action& act = actions[next[i]];
        const uint64_t id = base_id + static_cast<uint64_t>(act.index) - 1;
        if (act.op == Action::Op::kForward) {
          torch::Tensor x;
          if (i == 0) {
            x = inputs[act.index - 1];
          } else {
            auto it = activations[i].find(act.index);
            if (it == activations[i].end()) break;  // not received yet
            x = it->second;
            activations[i].erase(it);
          }
          if (rt.is_last()) {
            auto r = rt.ForwardLoss(id, x, targets[act.index - 1], true);
            if (!r.ok()) return r.status();
            losses[act.index - 1] = r->loss;
          } else {
            auto out = rt.Forward(id, x, true);
            if (!out.ok()) return out.status();
            activations[i + 1][act.index] = *out;
          }
        } else if (act.op == Action::Op::kBackward) {
          torch::Tensor grad;
          if (!rt.is_last()) {
            auto it = gradients[i].find(act.index);
            if (it == gradients[i].end()) break;
            grad = it->second;
            gradients[i].erase(it);
          }
          auto grad_input = rt.Backward(id, grad);
          if (!grad_input.ok()) return grad_input.status();
          if (i > 0) gradients[i - 1][act.index] = *grad_input;
        } else if (rt.Stats().steps != first_step + act.index) {
          return absl::InternalError(absl::StrCat("stage ", i, ": the plan's ", FormatAction(act),
                                                  " but the runtime has applied ", rt.Stats().steps,
                                                  " steps"));
        }
        ++next[i];
        progress = true;
        if (after_action) after_action(act);
      }
    }
  }
  for (int i = 0; i < P; ++i) {
    if (next[i] < plan->actions[i].size()) {
      return absl::InternalError(
          absl::StrCat("stage ", i, " stalled at ", FormatAction(plan->actions[i][next[i]])));
    }
  }
  return losses;
}

}  // namespace pipemare
