#include "pipeline/harness.h"

#include <deque>
#include <map>
#include <tuple>

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
    auto executor = StageExecutor::Create(a, runtime->get());
    if (!executor.ok()) return executor.status();
    h->runtimes_.push_back(std::move(*runtime));
    h->executors_.push_back(std::move(*executor));
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
  // The queues: activations stage i has received, in arrival order, and
  // gradients by microbatch id.
  std::vector<std::deque<std::pair<uint64_t, torch::Tensor>>> activations(P);
  std::vector<std::map<uint64_t, torch::Tensor>> gradients(P);
  std::vector<double> losses(M, 0);
  std::vector<size_t> fed(P, 0);  // forwards each stage has run this epoch
  auto stage_error = [](int i, const absl::Status& st) {
    return absl::Status(st.code(), absl::StrCat("stage ", i, ": ", st.message()));
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int i = 0; i < P; ++i) {
      StageExecutor& ex = executors_[i];
      for (;;) {
        auto local = ex.RunLocal();
        if (!local.ok()) return stage_error(i, local.status());
        StageExecutor::Output out;
        if (local->has_value()) {
          out = std::move(**local);
        } else {
          const StageExecutor::Next next = ex.Peek();
          if (next.action.op == Action::Op::kForward) {
            if (fed[i] == M) break;  // the epoch is done here
            uint64_t id;
            torch::Tensor x;
            if (i == 0) {
              id = base_id + fed[0];
              x = inputs[fed[0]];
            } else {
              if (activations[i].empty()) break;  // not received yet
              std::tie(id, x) = std::move(activations[i].front());
              activations[i].pop_front();
            }
            ++fed[i];
            auto f = ex.Forward(id, x, i + 1 == P ? targets[index_of(id)] : torch::Tensor());
            if (!f.ok()) return stage_error(i, f.status());
            out = std::move(*f);
          } else {
            auto it = gradients[i].find(next.microbatch);
            if (it == gradients[i].end()) break;  // not received yet
            torch::Tensor grad = std::move(it->second);
            gradients[i].erase(it);
            auto b = ex.Backward(next.microbatch, grad);
            if (!b.ok()) return stage_error(i, b.status());
            out = std::move(*b);
          }
        }
        if (out.loss) losses[index_of(out.microbatch)] = out.loss->loss;
        if (out.snapshot) cuts_[out.snapshot->step].push_back(out.snapshot);
        if (out.action.op == Action::Op::kForward && i + 1 < P) {
          activations[i + 1].emplace_back(out.microbatch, out.tensor);
        }
        if (out.action.op == Action::Op::kBackward && i > 0) {
          gradients[i - 1][out.microbatch] = out.tensor;
        }
        if (after_action) after_action(out.action);
        progress = true;
      }
    }
  }
  for (int i = 0; i < P; ++i) {
    if (!executors_[i].between_epochs() || fed[i] != M) {
      return absl::InternalError(
          absl::StrCat("stage ", i, " stalled at ", FormatAction(executors_[i].Peek().action)));
    }
  }
  return losses;
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
