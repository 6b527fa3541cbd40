// Schedules as data. A plan is, for each stage, the ordered actions of one
// epoch: forward of microbatch m (F), backward of m (B), the weight gradient
// of m (W, zero_bubble only: its B then computes only the input gradient),
// optimizer step k (U). Sends and receives are implied: F on stage i < P-1
// sends m's activation to stage i+1, which must forward m; B on stage i > 0
// sends m's gradient to stage i-1, which must run B of m. Printed compactly
// as "2F5 2B3 2W3 2U1" (stage, op, index; microbatches and steps 1-based
// within the epoch).
//
// BuildPlan writes the order the stage host follows (docs/algorithm.md):
//   gpipe, and every step of a synchronous warm-up: per step, every stage runs
//     the step's N forwards, then its N backwards, then U;
//   1f1b (PipeDream-flush): per step, stage i fills with min(P-i, N)
//     forwards, alternates one backward and one forward, drains the step's
//     remaining backwards (cool-down), then U; at most P-i activations held;
//   zero_bubble (ZB-H1, Qi et al., ICLR 2024): per step, each backward split
//     into B (input gradient, sent upstream at once) and W (weight
//     gradient); B first, F within 1f1b's fill and its peak memory (min(P, N)
//     microbatches held on any stage), W in the time 1f1b idles
//     (schedule.cc: ZeroBubbleStep);
//   pipemare, pipedream, pipedream_2bw, async: 1F1B without a flush. Stage i
//     keeps at most P-i forwards outstanding: it fills with P-i forwards,
//     then alternates one backward and one forward; after the epoch's last
//     forward it runs the remaining backwards (cool-down). U follows every
//     N-th backward.
// ValidatePlan refuses a plan that cannot run, naming the stage and action.
// PredictPlan runs the plan on a model of time (forward and backward costs
// per microbatch, transfers free) and counts its delays.
//
// No LibTorch: the client's `pipemarectl simulate` uses this.
#ifndef PIPEMARE_PIPELINE_SCHEDULE_H_
#define PIPEMARE_PIPELINE_SCHEDULE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

struct Action {
  enum class Op { kForward, kBackward, kWeight, kUpdate };
  int stage = 0;
  Op op = Op::kForward;
  int64_t index = 0;  // microbatch (F, B, W) or step (U), 1-based within the epoch

  bool operator==(const Action& o) const {
    return stage == o.stage && op == o.op && index == o.index;
  }
};

// "2F5", "2B3", "2W3", "2U1".
std::string FormatAction(const Action& action);

struct Plan {
  int stages = 0;                            // P
  int microbatches_per_step = 1;             // N
  std::vector<std::vector<Action>> actions;  // [stage] -> ordered actions
};

// The schedules (schedule.type), each named once: in ScheduleName, which
// ParseScheduleKind and the spec's validation read.
enum class ScheduleKind {
  kGPipe,
  kOneFOneB,
  kZeroBubble,
  kPipeDream,
  kPipeDream2BW,
  kAsync,
  kPipeMare
};
// "gpipe", "1f1b", "zero_bubble", "pipedream", "pipedream_2bw", "async",
// "pipemare".
const char* ScheduleName(ScheduleKind kind);
// The kind named `type`; INVALID_ARGUMENT naming schedule.type and the
// allowed names otherwise.
absl::StatusOr<ScheduleKind> ParseScheduleKind(absl::string_view type);
// A validated spec's schedule (the default, pipemare, if it were not).
ScheduleKind ScheduleKindOf(const v1::ScheduleSpec& schedule);
// gpipe, 1f1b and zero_bubble flush the pipeline at every step (no
// staleness); the others update asynchronously (after T3's warm-up).
inline bool IsAsynchronous(ScheduleKind kind) {
  return kind != ScheduleKind::kGPipe && kind != ScheduleKind::kOneFOneB &&
         kind != ScheduleKind::kZeroBubble;
}
// zero_bubble's plans split each backward into B and W.
inline bool SplitsBackward(ScheduleKind kind) { return kind == ScheduleKind::kZeroBubble; }
// Every backward differentiates at the weights its forward ran at (the
// synchronous schedules, pipedream's and pipedream_2bw's stashes), so a stage
// may keep the forward's graph instead of recomputing it
// (schedule.recompute). pipemare and async differentiate at other weights
// (w_t, T2's u_bkwd) than their forward's and must recompute.
inline bool BackwardUsesForwardWeights(ScheduleKind kind) {
  return kind != ScheduleKind::kAsync && kind != ScheduleKind::kPipeMare;
}
// schedule.recompute of a validated spec: as given, else true where it must
// be (pipemare, async) and false elsewhere.
bool Recomputes(const v1::ScheduleSpec& schedule);
// schedule.replicas, or 1 when unset.
inline int Replicas(const v1::ScheduleSpec& schedule) {
  return schedule.has_replicas() ? schedule.replicas() : 1;
}
inline constexpr int kMaxReplicas = 64;

struct PlanOptions {
  ScheduleKind schedule = ScheduleKind::kPipeMare;
  int stages = 1;
  int microbatches_per_step = 1;
  int64_t steps = 1;         // optimizer steps in the epoch
  int64_t first_step = 0;    // global index of the epoch's first step
  int64_t warmup_steps = 0;  // T3: global steps < warmup_steps run synchronously
};

// INVALID_ARGUMENT naming the field for a bad schedule, P, N or steps.
absl::StatusOr<Plan> BuildPlan(const PlanOptions& options);

// One stage's actions of BuildPlan(options), built alone (the stage executor
// builds its own plan lazily, epoch by epoch). INVALID_ARGUMENT as BuildPlan,
// or for a stage outside 0..P-1.
absl::StatusOr<std::vector<Action>> BuildStagePlan(const PlanOptions& options, int stage);

// OK if the plan can run: on every stage each microbatch is forwarded once
// and backwarded once, after its forward; every send has its receive; U
// follows every N-th backward; and executing the plan with unbounded
// buffers never deadlocks. Otherwise INVALID_ARGUMENT naming the stage and
// the action where it breaks.
absl::Status ValidatePlan(const Plan& plan);

// Each stage's plan on one line: "stage 2: 2F1 2F2 2B1 2U1 ...", at most
// `max_actions` actions per stage (0 = all) followed by "... (K more)".
std::string FormatPlan(const Plan& plan, int max_actions = 0);

struct StagePrediction {
  double busy = 0;         // time units of compute
  double utilization = 0;  // busy / makespan
  int max_delay = 0;       // most steps applied between a microbatch's F and B
  double mean_delay = 0;
  // Most microbatches held at once (forwarded, gradient not yet complete:
  // B done, or W under zero_bubble): the stage's activation memory in
  // microbatches.
  int max_held = 0;
};
struct Prediction {
  double makespan = 0;
  double mean_utilization = 0;
  std::vector<StagePrediction> stages;
};

// Runs a valid plan on a model of time: every stage's forward of a
// microbatch costs `forward_cost`, its backward `backward_cost` (split into
// B and W, W costs `weight_fraction` of it), a step and a transfer nothing;
// an action starts when its stage is free and what it receives has been
// sent.
Prediction PredictPlan(const Plan& plan, double forward_cost = 1, double backward_cost = 2,
                       double weight_fraction = 0.5);

// The most microbatches stage i of P holds at once under `kind` with N
// microbatches per step, by formula (after any warm-up): gpipe N; 1f1b
// min(P-i, N); zero_bubble min(P, N) on every stage (1f1b's peak, stage 0's;
// a microbatch is held until its W); the asynchronous ones P-i.
int HeldByFormula(ScheduleKind kind, int stages, int stage, int microbatches_per_step);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_SCHEDULE_H_
