#include "client/simulate.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/commands.h"
#include "client/format.h"
#include "pipeline/core/pipemare_math.h"
#include "pipeline/core/schedule.h"

namespace pipemare::client {

absl::StatusOr<std::string> RenderSimulation(const v1::JobSpec& spec,
                                             const SimulateOptions& options) {
  if (options.steps < 1) return absl::InvalidArgumentError("--steps: must be >= 1");
  if (!(options.backward_cost > 0)) {
    return absl::InvalidArgumentError("--backward-cost: must be > 0 (a forward costs 1)");
  }
  if (!(options.weight_share >= 0 && options.weight_share <= 1)) {
    return absl::InvalidArgumentError(
        "--weight-share: must be in [0, 1] (the weight gradient W's share of a backward)");
  }
  const auto& s = spec.schedule();
  const int64_t warmup =
      s.warmup_steps() > 0 ? s.warmup_steps()
                           : static_cast<int64_t>(std::llround(s.warmup_epochs() * options.steps));
  const ScheduleKind kind = ScheduleKindOf(s);
  PlanOptions plan_options{kind, s.stages(), s.microbatches_per_step(), options.steps, 0, warmup};
  auto plan = BuildPlan(plan_options);
  if (!plan.ok()) return plan.status();
  if (auto st = ValidatePlan(*plan); !st.ok()) return st;
  // A backward that recomputes runs the forward again first (schedule.recompute).
  auto predict = [&](const Plan& plan, bool recompute) {
    const double backward = options.backward_cost + (recompute ? 1 : 0);
    return PredictPlan(plan, 1, backward, options.backward_cost * options.weight_share / backward);
  };
  // The synchronous schedules recompute only if the spec says so.
  const bool sync_recompute = s.has_recompute() && s.recompute();
  // The synchronous schedules on the same pipeline, and the best of them.
  struct Synchronous {
    ScheduleKind kind;
    Prediction prediction;
  };
  std::vector<Synchronous> sync;
  for (ScheduleKind k :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubble}) {
    PlanOptions o = plan_options;
    o.schedule = k;
    auto sync_plan = BuildPlan(o);
    if (!sync_plan.ok()) return sync_plan.status();
    sync.push_back({k, predict(*sync_plan, sync_recompute)});
  }
  const Synchronous* best = &sync[0];
  for (const Synchronous& x : sync) {
    if (x.prediction.makespan < best->prediction.makespan) best = &x;
  }
  const Prediction p = predict(*plan, Recomputes(s));
  const Prediction& g = sync[0].prediction;
  const int P = s.stages(), N = s.microbatches_per_step();
  // With a synchronous warm-up, the asynchronous phase that follows it on
  // its own (the warm-up itself runs as gpipe does).
  std::optional<Prediction> after_warmup;
  if (IsAsynchronous(kind) && warmup > 0) {
    PlanOptions async_options = plan_options;
    async_options.schedule = kind;
    async_options.warmup_steps = 0;
    auto async_plan = BuildPlan(async_options);
    if (!async_plan.ok()) return async_plan.status();
    after_warmup = predict(*async_plan, Recomputes(s));
  }
  if (options.json) {
    nlohmann::json j = {
        {"schedule", ScheduleName(kind)},
        {"stages", P},
        {"microbatches_per_step", N},
        {"steps", options.steps},
        {"warmup_steps", warmup},
        {"backward_cost", options.backward_cost},
        {"weight_share", options.weight_share},
        {"recompute", Recomputes(s)},
        {"replicas", Replicas(s)},
        {"effective_batch", static_cast<int64_t>(Replicas(s)) * N * s.microbatch_size()},
        {"predicted_utilization", p.mean_utilization},
        {"gpipe_utilization", g.mean_utilization},
        {"throughput_vs_gpipe", g.makespan / p.makespan},
        {"best_synchronous", ScheduleName(best->kind)},
        {"throughput_vs_best_synchronous", best->prediction.makespan / p.makespan},
        {"synchronous", nlohmann::json::object()},
        {"per_stage", nlohmann::json::array()}};
    for (const Synchronous& x : sync) {
      j["synchronous"][ScheduleName(x.kind)] = {
          {"utilization", x.prediction.mean_utilization},
          {"throughput_vs_gpipe", g.makespan / x.prediction.makespan}};
    }
    if (after_warmup) {
      j["after_warmup_utilization"] = after_warmup->mean_utilization;
      j["after_warmup_throughput_vs_gpipe"] = g.makespan / after_warmup->makespan;
    }
    for (int i = 0; i < P; ++i) {
      const StagePrediction& st = p.stages[i];
      j["per_stage"].push_back({{"stage", i},
                                {"tau", st.max_delay},
                                {"mean_delay", st.mean_delay},
                                {"utilization", st.utilization},
                                {"held_microbatches", st.max_held},
                                {"held_by_formula", HeldByFormula(kind, P, i, N)}});
    }
    return j.dump(2) + "\n";
  }
  std::string out = Format("plan: %s, P=%d stages, N=%d microbatches per step, %lld steps",
                           ScheduleName(kind), P, N, static_cast<long long>(options.steps));
  if (IsAsynchronous(kind) && warmup > 0) {
    absl::StrAppend(&out, ", synchronous warm-up for the first ", warmup, " steps");
  }
  if (const int R = Replicas(s); R > 1) {
    // Each replica runs this plan on its own share of every step; the
    // stages' all-reduce before each U is not in the model of time.
    absl::StrAppend(&out, "\nreplicas: ", R, " pipelines of this plan (", R * P,
                    " workers), each stage all-reducing its gradients with its replicas before "
                    "each U; effective batch ",
                    static_cast<int64_t>(R) * N * s.microbatch_size(), " = ", R, " x ", N, " x ",
                    s.microbatch_size(), " examples per step");
  }
  absl::StrAppend(&out, "\n\n", FormatPlan(*plan, options.show), "\n");
  // HELD: the most microbatches the stage holds at once (its activation
  // memory: inputs under recompute, the forward's graph without).
  TextTable table({"STAGE", "TAU", "MEAN-DELAY", "UTILIZATION", "HELD"});
  for (int c = 0; c < 5; ++c) table.AlignRight(c);
  for (int i = 0; i < P; ++i) {
    const StagePrediction& st = p.stages[i];
    table.AddRow({Format("%d", i), Format("%d", st.max_delay), Format("%.2f", st.mean_delay),
                  Format("%.1f%%", 100 * st.utilization), Format("%d", st.max_held)});
  }
  absl::StrAppend(&out, table.Render());
  if (IsAsynchronous(kind)) {
    // schedule.microbatches_per_step trades delay against update frequency:
    // τ_i = ceil((P-1-i)/N), and an epoch has 1/N as many steps.
    absl::StrAppend(&out, "\nTAU by N (delay in steps; an epoch has 1/N as many steps):");
    for (int n : {1, 2, 4, 8, 16}) {
      if (n > 1 && n / 2 >= P) break;
      std::vector<std::string> taus;
      for (int i = 0; i < P; ++i) taus.push_back(Format("%d", AnalyticDelay(P, i, n)));
      absl::StrAppend(&out, "\n  N=", n, ": ", absl::StrJoin(taus, " "),
                      n == N ? "  (this spec)" : "");
    }
    absl::StrAppend(&out, "\n");
    if (s.spike_compensation()) {
      const double m = spec.optimizer().momentum();
      std::vector<std::string> coefficients;
      for (int i = 0; i < P; ++i) {
        const SpikeCoefficients c = SpikeCompensation(m, AnalyticDelay(P, i, N));
        coefficients.push_back(Format("%d: a=%.3g b=%.3g", i, c.a, c.b));
      }
      absl::StrAppend(&out, "spike compensation (momentum ", Format("%.3g", m),
                      ", w -= lr*(a*v + b*g)): ", absl::StrJoin(coefficients, ", "), "\n");
    }
  }
  absl::StrAppend(
      &out,
      Format("\npredicted mean utilization %.1f%%; gpipe on the same pipeline %.1f%% "
             "(N/(N+P-1) = %.1f%%); throughput %.2fx gpipe's\n",
             100 * p.mean_utilization, 100 * g.mean_utilization, 100.0 * N / (N + P - 1),
             g.makespan / p.makespan),
      after_warmup
          ? Format("after the synchronous warm-up of %lld steps: %.1f%%, throughput %.2fx "
                   "gpipe's%s\n",
                   static_cast<long long>(warmup), 100 * after_warmup->mean_utilization,
                   g.makespan / after_warmup->makespan,
                   warmup >= options.steps
                       ? " (the simulated steps are all warm-up: raise --steps to see both)"
                       : "")
          : std::string(),
      Format("synchronous schedules here: gpipe %.1f%%, 1f1b %.1f%%, zero_bubble %.1f%%; "
             "%s's throughput is %.2fx the best of them (%s)\n",
             100 * sync[0].prediction.mean_utilization, 100 * sync[1].prediction.mean_utilization,
             100 * sync[2].prediction.mean_utilization, ScheduleName(kind),
             best->prediction.makespan / p.makespan, ScheduleName(best->kind)),
      Format("each stage holds %s microbatches' %s at most (HELD)\n",
             kind == ScheduleKind::kGPipe        ? "N"
             : kind == ScheduleKind::kZeroBubble ? "min(P, N)"
             : IsAsynchronous(kind)              ? "P-i"
                                                 : "min(P-i, N)",
             Recomputes(s) ? "inputs (schedule.recompute)" : "forward graphs"),
      Format("(model of time: a forward costs 1 and a backward %.3g per microbatch on every "
             "stage, zero_bubble's W %.0f%% of it, and 1 more where it recomputes the forward "
             "(%s does%s); steps and transfers are free)\n",
             options.backward_cost, 100 * options.weight_share, ScheduleName(kind),
             Recomputes(s) ? "" : " not"));
  return out;
}

int RunSimulate(const SimulateOptions& options) {
  absl::StatusOr<v1::JobSpec> spec = LoadValidSpec(options.spec_file);
  if (!spec.ok()) return kExitBadInput;
  auto report = RenderSimulation(*spec, options);
  if (!report.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(report.status().message()).c_str());
    return kExitBadInput;
  }
  std::fputs(report->c_str(), stdout);
  return kExitOk;
}

}  // namespace pipemare::client
