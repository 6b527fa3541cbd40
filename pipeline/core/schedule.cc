#include "pipeline/core/schedule.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pipemare {
namespace {

using Op = Action::Op;

absl::Status Bad(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::Status Broken(int stage, size_t position, const Action& action, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("plan breaks at stage ", stage, ", action ",
                                                 position + 1, " (", FormatAction(action),
                                                 "): ", what));
}

}  // namespace

std::string FormatAction(const Action& a) {
  const char op = a.op == Op::kForward ? 'F' : a.op == Op::kBackward ? 'B' : 'U';
  return absl::StrCat(a.stage, std::string(1, op), a.index);
}

namespace {
constexpr ScheduleKind kScheduleKinds[] = {ScheduleKind::kPipeMare, ScheduleKind::kGPipe,
                                           ScheduleKind::kPipeDream, ScheduleKind::kAsync};
}  // namespace

const char* ScheduleName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::kPipeDream:
      return "pipedream";
    case ScheduleKind::kAsync:
      return "async";
    case ScheduleKind::kPipeMare:
      return "pipemare";
  }
  return "pipemare";
}

absl::StatusOr<ScheduleKind> ParseScheduleKind(absl::string_view type) {
  std::string allowed;
  for (ScheduleKind kind : kScheduleKinds) {
    if (type == ScheduleName(kind)) return kind;
    absl::StrAppend(&allowed, allowed.empty() ? "" : ", ", ScheduleName(kind));
  }
  if (type.empty()) return Bad("schedule.type", absl::StrCat("required; allowed: ", allowed));
  return Bad("schedule.type", absl::StrCat("'", type, "' is not allowed; allowed: ", allowed));
}

ScheduleKind ScheduleKindOf(const v1::ScheduleSpec& schedule) {
  return ParseScheduleKind(schedule.type()).value_or(ScheduleKind::kPipeMare);
}

absl::StatusOr<std::vector<Action>> BuildStagePlan(const PlanOptions& o, int stage) {
  if (o.stages < 1) return Bad("schedule.stages", "must be >= 1");
  if (stage < 0 || stage >= o.stages) {
    return Bad("stage", absl::StrCat(stage, " is not in 0..", o.stages - 1));
  }
  if (o.microbatches_per_step < 1) return Bad("schedule.microbatches_per_step", "must be >= 1");
  if (o.steps < 1) return Bad("steps", "must be >= 1");
  if (o.first_step < 0 || o.warmup_steps < 0) return Bad("warmup_steps", "must be >= 0");
  const int P = o.stages;
  const int i = stage;
  const int64_t N = o.microbatches_per_step;
  // Steps [0, sync_steps) of the epoch run synchronously.
  const int64_t sync_steps = !IsAsynchronous(o.schedule)
                                 ? o.steps
                                 : std::clamp<int64_t>(o.warmup_steps - o.first_step, 0, o.steps);
  std::vector<Action> a;
  int64_t backwards = 0, updates = 0;
  auto forward = [&](int64_t m) { a.push_back({i, Op::kForward, m}); };
  auto backward = [&](int64_t m) {
    a.push_back({i, Op::kBackward, m});
    if (++backwards % N == 0) a.push_back({i, Op::kUpdate, ++updates});
  };
  for (int64_t s = 0; s < sync_steps; ++s) {
    for (int64_t m = s * N + 1; m <= (s + 1) * N; ++m) forward(m);
    for (int64_t m = s * N + 1; m <= (s + 1) * N; ++m) backward(m);
  }
  // 1F1B: at most P - i forwards outstanding; cool-down after the last.
  const int64_t last = o.steps * N;
  const int64_t depth = P - i;
  int64_t next_f = sync_steps * N + 1, next_b = next_f;
  while (next_b <= last) {
    if (next_f <= last && next_f - next_b < depth) {
      forward(next_f++);
    } else {
      backward(next_b++);
    }
  }
  return a;
}

absl::StatusOr<Plan> BuildPlan(const PlanOptions& o) {
  Plan plan;
  plan.stages = o.stages;
  plan.microbatches_per_step = o.microbatches_per_step;
  for (int i = 0; i < std::max(o.stages, 1); ++i) {
    auto actions = BuildStagePlan(o, i);
    if (!actions.ok()) return actions.status();
    plan.actions.push_back(std::move(*actions));
  }
  return plan;
}

absl::Status ValidatePlan(const Plan& plan) {
  const int P = plan.stages;
  const int64_t N = plan.microbatches_per_step;
  if (P < 1 || static_cast<int>(plan.actions.size()) != P) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan has ", plan.actions.size(), " stage lists for ", P, " stages"));
  }
  if (N < 1) return absl::InvalidArgumentError("plan: microbatches_per_step must be >= 1");
  std::vector<std::set<int64_t>> forwarded(P);
  for (int i = 0; i < P; ++i) {
    std::set<int64_t> backwarded;
    int64_t backwards = 0, updates = 0;
    const auto& actions = plan.actions[i];
    for (size_t k = 0; k < actions.size(); ++k) {
      const Action& a = actions[k];
      if (a.stage != i) return Broken(i, k, a, absl::StrCat("belongs to stage ", a.stage));
      switch (a.op) {
        case Op::kForward:
          if (!forwarded[i].insert(a.index).second) {
            return Broken(i, k, a, absl::StrCat("microbatch ", a.index, " is forwarded twice"));
          }
          break;
        case Op::kBackward:
          if (!forwarded[i].count(a.index)) {
            return Broken(
                i, k, a, absl::StrCat("microbatch ", a.index, " is backwarded before its forward"));
          }
          if (!backwarded.insert(a.index).second) {
            return Broken(i, k, a, absl::StrCat("microbatch ", a.index, " is backwarded twice"));
          }
          ++backwards;
          break;
        case Op::kUpdate:
          if (a.index != updates + 1) {
            return Broken(i, k, a, absl::StrCat("step ", a.index, " follows step ", updates));
          }
          if (backwards != a.index * N) {
            return Broken(i, k, a,
                          absl::StrCat("a step after ", backwards, " backwards; each step takes ",
                                       N, " (microbatches_per_step)"));
          }
          ++updates;
          break;
      }
    }
    for (int64_t m : forwarded[i]) {
      if (!backwarded.count(m)) {
        return absl::InvalidArgumentError(absl::StrCat("plan breaks at stage ", i, ": microbatch ",
                                                       m, " is forwarded but never backwarded"));
      }
    }
    if (updates * N != backwards) {
      return absl::InvalidArgumentError(absl::StrCat("plan breaks at stage ", i, ": the last ",
                                                     backwards - updates * N,
                                                     " backwards are never followed by a step"));
    }
  }
  // Every send has its receive: activations i -> i+1 (gradients go back the
  // same way, and every forwarded microbatch is backwarded on its stage).
  for (int i = 0; i + 1 < P; ++i) {
    for (int64_t m : forwarded[i]) {
      if (!forwarded[i + 1].count(m)) {
        return absl::InvalidArgumentError(absl::StrCat("plan breaks at stage ", i, ": ", i, "F", m,
                                                       " sends to stage ", i + 1,
                                                       ", which never forwards microbatch ", m));
      }
    }
    for (int64_t m : forwarded[i + 1]) {
      if (!forwarded[i].count(m)) {
        return absl::InvalidArgumentError(absl::StrCat("plan breaks at stage ", i + 1, ": ", i + 1,
                                                       "F", m, " waits for an activation stage ", i,
                                                       " never sends"));
      }
    }
  }
  // No deadlock: run it with unbounded buffers.
  std::vector<size_t> next(P, 0);
  std::vector<std::set<int64_t>> done_f(P), done_b(P);
  auto waits_for = [&](int i, const Action& a) -> std::string {
    if (a.op == Op::kForward && i > 0 && !done_f[i - 1].count(a.index)) {
      return absl::StrCat(i - 1, "F", a.index);
    }
    if (a.op == Op::kBackward && i + 1 < P && !done_b[i + 1].count(a.index)) {
      return absl::StrCat(i + 1, "B", a.index);
    }
    return "";
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int i = 0; i < P; ++i) {
      while (next[i] < plan.actions[i].size()) {
        const Action& a = plan.actions[i][next[i]];
        if (!waits_for(i, a).empty()) break;
        if (a.op == Op::kForward) done_f[i].insert(a.index);
        if (a.op == Op::kBackward) done_b[i].insert(a.index);
        ++next[i];
        progress = true;
      }
    }
  }
  std::vector<std::string> stuck;
  for (int i = 0; i < P; ++i) {
    if (next[i] < plan.actions[i].size()) {
      const Action& a = plan.actions[i][next[i]];
      stuck.push_back(absl::StrCat("stage ", i, " at action ", next[i] + 1, " (", FormatAction(a),
                                   ") waits for ", waits_for(i, a)));
    }
  }
  if (!stuck.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("plan deadlocks: ", absl::StrJoin(stuck, "; ")));
  }
  return absl::OkStatus();
}

std::string FormatPlan(const Plan& plan, int max_actions) {
  std::string out;
  for (int i = 0; i < plan.stages; ++i) {
    const auto& actions = plan.actions[i];
    const size_t shown =
        max_actions > 0 ? std::min<size_t>(actions.size(), max_actions) : actions.size();
    std::vector<std::string> words;
    for (size_t k = 0; k < shown; ++k) words.push_back(FormatAction(actions[k]));
    absl::StrAppend(&out, "stage ", i, ": ", absl::StrJoin(words, " "));
    if (shown < actions.size()) absl::StrAppend(&out, " ... (", actions.size() - shown, " more)");
    out += "\n";
  }
  return out;
}

Prediction PredictPlan(const Plan& plan, double forward_cost, double backward_cost) {
  const int P = plan.stages;
  Prediction p;
  p.stages.resize(P);
  std::vector<size_t> next(P, 0);
  std::vector<double> clock(P, 0);
  std::vector<std::map<int64_t, double>> end_f(P), end_b(P);
  for (bool progress = true; progress;) {
    progress = false;
    for (int i = 0; i < P; ++i) {
      while (next[i] < plan.actions[i].size()) {
        const Action& a = plan.actions[i][next[i]];
        double ready = clock[i], cost = 0;
        if (a.op == Op::kForward) {
          if (i > 0) {
            auto it = end_f[i - 1].find(a.index);
            if (it == end_f[i - 1].end()) break;
            ready = std::max(ready, it->second);
          }
          cost = forward_cost;
        } else if (a.op == Op::kBackward) {
          if (i + 1 < P) {
            auto it = end_b[i + 1].find(a.index);
            if (it == end_b[i + 1].end()) break;
            ready = std::max(ready, it->second);
          }
          cost = backward_cost;
        }
        clock[i] = ready + cost;
        p.stages[i].busy += cost;
        if (a.op == Op::kForward) end_f[i][a.index] = clock[i];
        if (a.op == Op::kBackward) end_b[i][a.index] = clock[i];
        ++next[i];
        progress = true;
      }
    }
  }
  p.makespan = *std::max_element(clock.begin(), clock.end());
  for (int i = 0; i < P; ++i) {
    StagePrediction& s = p.stages[i];
    s.utilization = p.makespan > 0 ? s.busy / p.makespan : 0;
    p.mean_utilization += s.utilization / P;
    // Delay of m: steps applied on the stage between its F and its B.
    std::map<int64_t, int64_t> steps_at_forward;
    int64_t steps = 0, sum = 0, count = 0;
    for (const Action& a : plan.actions[i]) {
      if (a.op == Op::kUpdate) ++steps;
      if (a.op == Op::kForward) steps_at_forward[a.index] = steps;
      if (a.op == Op::kBackward) {
        const int64_t d = steps - steps_at_forward[a.index];
        s.max_delay = std::max<int>(s.max_delay, static_cast<int>(d));
        sum += d;
        ++count;
      }
    }
    s.mean_delay = count ? static_cast<double>(sum) / count : 0;
  }
  return p;
}

}  // namespace pipemare
