// What a run decides before any stage loads, without I/O to the workers:
// the job's data, the model checked against it, the cut into stages
// (schedule.partition), the steps, and each stage's resolved assignment
// (checkpoint directory, generation, input and output shapes); a plan that
// cannot run is refused here. Profiling (partition "profile") is the
// caller's: it times the units on the workers.
#ifndef PIPEMARE_COORDINATOR_RUN_PLAN_H_
#define PIPEMARE_COORDINATOR_RUN_PLAN_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/cut_committer.h"
#include "pipeline/core/checkpoint.h"
#include "pipeline/core/data.h"
#include "pipeline/core/partition.h"
#include "pipeline/model/model_plan.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

struct RunPlan {
  Data data;        // the job's examples
  bool lm = false;  // a language model: perplexity and token accuracy
  // The cut: the partitioner used, each stage's units, parameters and (with
  // "profile") predicted seconds per microbatch, and the bottleneck by the
  // partitioner's own cost (seconds, parameters, or units).
  std::string partition;
  std::vector<StageRange> ranges;
  std::vector<double> stage_parameters;
  std::vector<double> predicted_seconds;
  int bottleneck = 0;
  int64_t steps_per_epoch = 0;
  int64_t total_steps = 0;
  int64_t warmup_steps = 0;  // T3: synchronous for the first W steps
  // One per stage, resolved; downstream addresses are the loader's.
  std::vector<v1::StageAssignment> assignments;
  CutCommitter::Run cuts;  // what the run's checkpoint manifests record
};

// Times every unit on each stage's worker: cost[stage][unit] in seconds.
using ProfileUnits =
    std::function<absl::StatusOr<std::vector<std::vector<double>>>(const ModelPlan& plan)>;

// The plan of generation `generation` of job `job_id` on `stages` stages.
// `checkpoint_dir`: where cuts go when the spec names no checkpoint.dir.
// Errors name the field: INVALID_ARGUMENT for data or a model that no longer
// fits it (both were checked at submit; the files may have changed since).
// `first`: the data's files as the job's first run read them (JobStatus.
// data_files; empty on that first run): the coordinator's copy must still
// match. The stages check theirs against the run's manifest.
absl::StatusOr<RunPlan> MakeRunPlan(const v1::JobSpec& spec, const std::string& job_id,
                                    int64_t generation, const std::string& checkpoint_dir,
                                    int64_t max_model_bytes, const ProfileUnits& profile,
                                    const google::protobuf::RepeatedPtrField<v1::DataFile>& first);

// Each stage's units' files of the cut `m` (any partition's: by unit index)
// go into its assignment's restore list.
void AddRestoreFiles(const Manifest& m, std::vector<v1::StageAssignment>& assignments);

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_RUN_PLAN_H_
