// Schedules as data. A plan is, for each stage, the ordered actions of one
// epoch: forward of microbatch m (F), backward of m (B), optimizer step k
// (U). Sends and receives are implied: F on stage i < P-1 sends m's
// activation to stage i+1, which must forward m; B on stage i > 0 sends m's
// gradient to stage i-1, which must run B of m. Printed compactly as
// "2F5 2B3 2U1" (stage, op, index; microbatches and steps 1-based within the
// epoch).
//
// BuildPlan writes the order the stage host follows (docs/algorithm.md):
//   gpipe, and every step of a synchronous warm-up: per step, every stage runs
//     the step's N forwards, then its N backwards, then U;
//   pipemare, pipedream, async: 1F1B. Stage i keeps at most P-i forwards
//     outstanding: it fills with P-i forwards, then alternates one backward
//     and one forward; after the epoch's last forward it runs the remaining
//     backwards (cool-down). U follows every N-th backward.
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
  enum class Op { kForward, kBackward, kUpdate };
  int stage = 0;
  Op op = Op::kForward;
  int64_t index = 0;  // microbatch (F, B) or step (U), 1-based within the epoch

  bool operator==(const Action& o) const {
    return stage == o.stage && op == o.op && index == o.index;
  }
};

// "2F5", "2B3", "2U1".
std::string FormatAction(const Action& action);

struct Plan {
  int stages = 0;                            // P
  int microbatches_per_step = 1;             // N
  std::vector<std::vector<Action>> actions;  // [stage] -> ordered actions
};

// The schedules (schedule.type), each named once: in ScheduleName, which
// ParseScheduleKind and the spec's validation read.
enum class ScheduleKind { kGPipe, kPipeDream, kAsync, kPipeMare };
// "gpipe", "pipedream", "async", "pipemare".
const char* ScheduleName(ScheduleKind kind);
// The kind named `type`; INVALID_ARGUMENT naming schedule.type and the
// allowed names otherwise.
absl::StatusOr<ScheduleKind> ParseScheduleKind(absl::string_view type);
// A validated spec's schedule (the default, pipemare, if it were not).
ScheduleKind ScheduleKindOf(const v1::ScheduleSpec& schedule);
// Every schedule but gpipe updates asynchronously (after T3's warm-up).
inline bool IsAsynchronous(ScheduleKind kind) { return kind != ScheduleKind::kGPipe; }

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
};
struct Prediction {
  double makespan = 0;
  double mean_utilization = 0;
  std::vector<StagePrediction> stages;
};

// Runs a valid plan on a model of time: every stage's forward of a
// microbatch costs `forward_cost`, its backward `backward_cost`, a step and
// a transfer nothing; an action starts when its stage is free and what it
// receives has been sent.
Prediction PredictPlan(const Plan& plan, double forward_cost = 1, double backward_cost = 2);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_SCHEDULE_H_
