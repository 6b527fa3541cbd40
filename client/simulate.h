// `pipemarectl simulate FILE`: prints each stage's plan for one epoch of the
// job (pipeline/core/schedule.h), the utilization, delays and activation
// memory (microbatches held per stage) it predicts, next to the synchronous
// schedules (gpipe, 1f1b, zero_bubble) on the same pipeline. Runs nothing,
// needs no coordinator.
#ifndef PIPEMARE_CLIENT_SIMULATE_H_
#define PIPEMARE_CLIENT_SIMULATE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare::client {

struct SimulateOptions {
  std::string spec_file;
  int64_t steps = 100;        // optimizer steps in the simulated epoch
  int show = 24;              // actions printed per stage (0 = all)
  double backward_cost = 2;   // a backward's cost relative to a forward's
  double weight_share = 0.5;  // zero_bubble: W's share of the backward
  bool json = false;          // one JSON document instead of the text report
};

// The report for a validated spec; INVALID_ARGUMENT naming the option or
// field when the plan cannot be built.
absl::StatusOr<std::string> RenderSimulation(const v1::JobSpec& spec,
                                             const SimulateOptions& options);

// Exit code: 0, or 2 for a bad spec or option (the error on stderr).
int RunSimulate(const SimulateOptions& options);

}  // namespace pipemare::client

#endif  // PIPEMARE_CLIENT_SIMULATE_H_
