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
  const auto& s = spec.schedule();
  const int64_t warmup =
      s.warmup_steps() > 0 ? s.warmup_steps()
                           : static_cast<int64_t>(std::llround(s.warmup_epochs() * options.steps));
  const ScheduleKind kind = ScheduleKindOf(s);
  PlanOptions plan_options{kind, s.stages(), s.microbatches_per_step(), options.steps, 0, warmup};
  auto plan = BuildPlan(plan_options);
  if (!plan.ok()) return plan.status();
  if (auto st = ValidatePlan(*plan); !st.ok()) return st;
  plan_options.schedule = ScheduleKind::kGPipe;
  auto gpipe = BuildPlan(plan_options);
  if (!gpipe.ok()) return gpipe.status();

  const Prediction p = PredictPlan(*plan, 1, options.backward_cost);
  const Prediction g = PredictPlan(*gpipe, 1, options.backward_cost);
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
    after_warmup = PredictPlan(*async_plan, 1, options.backward_cost);
  }
  if (options.json) {
    nlohmann::json j = {{"schedule", ScheduleName(kind)},
                        {"stages", P},
                        {"microbatches_per_step", N},
                        {"steps", options.steps},
                        {"warmup_steps", warmup},
                        {"backward_cost", options.backward_cost},
                        {"predicted_utilization", p.mean_utilization},
                        {"gpipe_utilization", g.mean_utilization},
                        {"throughput_vs_gpipe", g.makespan / p.makespan},
                        {"per_stage", nlohmann::json::array()}};
    if (after_warmup) {
      j["after_warmup_utilization"] = after_warmup->mean_utilization;
      j["after_warmup_throughput_vs_gpipe"] = g.makespan / after_warmup->makespan;
    }
    for (int i = 0; i < P; ++i) {
      const StagePrediction& st = p.stages[i];
      j["per_stage"].push_back({{"stage", i},
                                {"tau", st.max_delay},
                                {"mean_delay", st.mean_delay},
                                {"utilization", st.utilization}});
    }
    return j.dump(2) + "\n";
  }
  std::string out = Format("plan: %s, P=%d stages, N=%d microbatches per step, %lld steps",
                           ScheduleName(kind), P, N, static_cast<long long>(options.steps));
  if (IsAsynchronous(kind) && warmup > 0) {
    absl::StrAppend(&out, ", synchronous warm-up for the first ", warmup, " steps");
  }
  absl::StrAppend(&out, "\n\n", FormatPlan(*plan, options.show), "\n");
  TextTable table({"STAGE", "TAU", "MEAN-DELAY", "UTILIZATION"});
  for (int c = 0; c < 4; ++c) table.AlignRight(c);
  for (int i = 0; i < P; ++i) {
    const StagePrediction& st = p.stages[i];
    table.AddRow({Format("%d", i), Format("%d", st.max_delay), Format("%.2f", st.mean_delay),
                  Format("%.1f%%", 100 * st.utilization)});
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
      Format("(model of time: a forward costs 1 and a backward %.3g per microbatch on every "
             "stage; steps and transfers are free)\n",
             options.backward_cost));
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
