#include "pipeline/core/schedule.h"

#include <algorithm>
#include <deque>
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
  const char op = a.op == Op::kForward    ? 'F'
                  : a.op == Op::kBackward ? 'B'
                  : a.op == Op::kWeight   ? 'W'
                                          : 'U';
  return absl::StrCat(a.stage, std::string(1, op), a.index);
}

namespace {
constexpr ScheduleKind kScheduleKinds[] = {ScheduleKind::kPipeMare,  ScheduleKind::kGPipe,
                                           ScheduleKind::kOneFOneB,  ScheduleKind::kZeroBubble,
                                           ScheduleKind::kPipeDream, ScheduleKind::kPipeDream2BW,
                                           ScheduleKind::kAsync};
}  // namespace

const char* ScheduleName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kZeroBubble:
      return "zero_bubble";
    case ScheduleKind::kPipeDream:
      return "pipedream";
    case ScheduleKind::kPipeDream2BW:
      return "pipedream_2bw";
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

bool Recomputes(const v1::ScheduleSpec& schedule) {
  if (!BackwardUsesForwardWeights(ScheduleKindOf(schedule))) return true;
  return schedule.has_recompute() && schedule.recompute();
}

int HeldByFormula(ScheduleKind kind, int stages, int stage, int microbatches_per_step) {
  const int depth = stages - stage;
  switch (kind) {
    case ScheduleKind::kGPipe:
      return microbatches_per_step;
    case ScheduleKind::kOneFOneB:
      return std::min(depth, microbatches_per_step);
    case ScheduleKind::kZeroBubble:
      return std::min(stages, microbatches_per_step);
    default:
      return depth;
  }
}

namespace {

// ZB-H1's order for one synchronous step of microbatches 1..N, every stage's
// (the handcrafted schedule of Qi et al., found greedily): on the model of
// time in which F, B and W each cost one unit and transfers are free, each
// stage, when free, runs the first of: B of its next microbatch once the
// gradient is there (the critical path upstream); F of its next one once
// the activation is there, while fewer than min(P-i, N) await their B (1f1b's
// fill) and it holds fewer than min(P, N) microbatches (forwarded, W not yet
// run: 1f1b's peak activation memory, stage 0's, which ZB-H1 keeps); the
// oldest pending W. Otherwise it idles until one of those can run. At
// P = N = 8 the bubble is (P-1)(F+B-W) = 7 units a step against 1f1b's 21,
// the paper's third.
std::vector<std::vector<Action>> ZeroBubbleStep(int P, int64_t N) {
  constexpr double kNever = 1e300;
  std::vector<std::vector<Action>> out(P);
  const int64_t budget = std::min<int64_t>(P, N);  // 1f1b's largest activation memory
  std::vector<double> clock(P, 0);
  std::vector<int64_t> next_f(P, 1), next_b(P, 1);
  std::vector<std::deque<int64_t>> pending(P);
  std::vector<std::map<int64_t, double>> end_f(P), end_b(P);
  auto ready_at = [&](const std::map<int64_t, double>& ends, int64_t m) {
    auto it = ends.find(m);
    return it == ends.end() ? kNever : it->second;
  };
  for (int64_t left = 3 * N * P; left > 0;) {
    // The stage that can start an action soonest runs it (ties: the lower
    // stage), so each stage's choices see every earlier event.
    int best = -1;
    double best_start = kNever;
    Action::Op best_op = Op::kForward;
    for (int i = 0; i < P; ++i) {
      const int64_t depth = std::min<int64_t>(P - i, N);
      const double b_ready = next_b[i] > N || next_b[i] >= next_f[i]
                                 ? kNever
                                 : (i + 1 < P ? ready_at(end_b[i + 1], next_b[i]) : clock[i]);
      const int64_t held = next_f[i] - next_b[i] + static_cast<int64_t>(pending[i].size());
      const double f_ready = next_f[i] > N || next_f[i] - next_b[i] >= depth || held >= budget
                                 ? kNever
                                 : (i > 0 ? ready_at(end_f[i - 1], next_f[i]) : clock[i]);
      // W when neither B nor F can start now.
      const bool w_possible = !pending[i].empty();
      double start;
      Op op;
      const double b_start = std::max(clock[i], b_ready);
      const double f_start = std::max(clock[i], f_ready);
      if (b_start <= clock[i]) {
        start = b_start, op = Op::kBackward;
      } else if (f_start <= clock[i]) {
        start = f_start, op = Op::kForward;
      } else if (w_possible) {
        start = clock[i], op = Op::kWeight;
      } else if (b_start <= f_start) {
        start = b_start, op = Op::kBackward;
      } else {
        start = f_start, op = Op::kForward;
      }
      if (start < best_start) best = i, best_start = start, best_op = op;
    }
    if (best < 0) break;  // cannot happen for a valid P, N
    const int i = best;
    clock[i] = best_start + 1;
    --left;
    switch (best_op) {
      case Op::kForward:
        out[i].push_back({i, Op::kForward, next_f[i]});
        end_f[i][next_f[i]++] = clock[i];
        break;
      case Op::kBackward:
        out[i].push_back({i, Op::kBackward, next_b[i]});
        pending[i].push_back(next_b[i]);
        end_b[i][next_b[i]++] = clock[i];
        break;
      default:
        out[i].push_back({i, Op::kWeight, pending[i].front()});
        pending[i].pop_front();
        break;
    }
  }
  return out;
}

}  // namespace

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
  // Gradients completed (B, or W where the plan splits it): U after every
  // N-th.
  int64_t completed = 0, updates = 0;
  auto forward = [&](int64_t m) { a.push_back({i, Op::kForward, m}); };
  auto complete = [&] {
    if (++completed % N == 0) a.push_back({i, Op::kUpdate, ++updates});
  };
  // Microbatches first..last in one-forward-one-backward order: fill with
  // `depth` forwards, then one backward and one forward, then the remaining
  // backwards.
  auto one_f_one_b = [&](int64_t first, int64_t last, int64_t depth) {
    for (int64_t next_f = first, next_b = first; next_b <= last;) {
      if (next_f <= last && next_f - next_b < depth) {
        forward(next_f++);
      } else {
        a.push_back({i, Op::kBackward, next_b++});
        complete();
      }
    }
  };
  std::vector<Action> zb;  // zero_bubble: this stage's order within a step
  for (int64_t s = 0; s < sync_steps; ++s) {
    const int64_t first = s * N + 1, last = (s + 1) * N;
    switch (o.schedule) {
      case ScheduleKind::kOneFOneB:
        one_f_one_b(first, last, std::min<int64_t>(P - i, N));
        break;
      case ScheduleKind::kZeroBubble:
        if (zb.empty()) zb = ZeroBubbleStep(P, N)[i];
        for (const Action& z : zb) {
          if (z.op == Op::kBackward) {
            a.push_back({i, Op::kBackward, s * N + z.index});
          } else if (z.op == Op::kWeight) {
            a.push_back({i, Op::kWeight, s * N + z.index});
            complete();
          } else {
            forward(s * N + z.index);
          }
        }
        break;
      default:  // gpipe, and the asynchronous schedules' warm-up
        one_f_one_b(first, last, N);
        break;
    }
  }
  // Asynchronous: 1F1B without a flush, at most P - i forwards outstanding;
  // cool-down after the epoch's last forward.
  if (sync_steps < o.steps) one_f_one_b(sync_steps * N + 1, o.steps * N, P - i);
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
    std::set<int64_t> backwarded, weighted;
    const auto& actions = plan.actions[i];
    // A stage whose plan has any W splits every backward: its steps count
    // W's, otherwise B's.
    const bool split = std::any_of(actions.begin(), actions.end(),
                                   [](const Action& a) { return a.op == Op::kWeight; });
    const char* counted = split ? "weight gradients (W)" : "backwards";
    int64_t completed = 0, updates = 0;
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
          if (!split) ++completed;
          break;
        case Op::kWeight:
          if (!backwarded.count(a.index)) {
            return Broken(i, k, a,
                          absl::StrCat("microbatch ", a.index,
                                       "'s weight gradient comes before its backward"));
          }
          if (!weighted.insert(a.index).second) {
            return Broken(i, k, a,
                          absl::StrCat("microbatch ", a.index, "'s weight gradient runs twice"));
          }
          ++completed;
          break;
        case Op::kUpdate:
          if (a.index != updates + 1) {
            return Broken(i, k, a, absl::StrCat("step ", a.index, " follows step ", updates));
          }
          if (completed != a.index * N) {
            return Broken(i, k, a,
                          absl::StrCat("a step after ", completed, " ", counted,
                                       "; each step takes ", N, " (microbatches_per_step)"));
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
      if (split && !weighted.count(m)) {
        return absl::InvalidArgumentError(absl::StrCat("plan breaks at stage ", i, ": microbatch ",
                                                       m, " never gets its weight gradient (W)"));
      }
    }
    if (updates * N != completed) {
      return absl::InvalidArgumentError(absl::StrCat("plan breaks at stage ", i, ": the last ",
                                                     completed - updates * N, " ", counted,
                                                     " are never followed by a step"));
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

Prediction PredictPlan(const Plan& plan, double forward_cost, double backward_cost,
                       double weight_fraction) {
  const int P = plan.stages;
  Prediction p;
  p.stages.resize(P);
  std::vector<size_t> next(P, 0);
  std::vector<double> clock(P, 0);
  std::vector<std::map<int64_t, double>> end_f(P), end_b(P);
  std::vector<bool> split(P, false);
  for (int i = 0; i < P; ++i) {
    for (const Action& a : plan.actions[i]) split[i] = split[i] || a.op == Op::kWeight;
  }
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
          cost = split[i] ? backward_cost * (1 - weight_fraction) : backward_cost;
        } else if (a.op == Op::kWeight) {
          cost = backward_cost * weight_fraction;
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
    int64_t steps = 0, sum = 0, count = 0, held = 0;
    for (const Action& a : plan.actions[i]) {
      if (a.op == Op::kUpdate) ++steps;
      if (a.op == Op::kForward) {
        steps_at_forward[a.index] = steps;
        s.max_held = std::max<int>(s.max_held, static_cast<int>(++held));
      }
      if (a.op == (split[i] ? Op::kWeight : Op::kBackward)) --held;
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
