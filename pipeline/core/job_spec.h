// Job specs: YAML or JSON files mapped onto pipemare.v1.JobSpec, defaults, and
// validation. Every error names the field path ("schedule.stages") and what is
// allowed, so a user can fix the file without reading code.
#ifndef PIPEMARE_PIPELINE_JOB_SPEC_H_
#define PIPEMARE_PIPELINE_JOB_SPEC_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/message.h"
#include "pipeline/core/partition.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// Parses a YAML or JSON document (JSON is YAML) onto a JobSpec. Unknown
// fields, wrong types and malformed documents are INVALID_ARGUMENT naming the
// field. Does not apply defaults or check ranges: see ValidateJobSpec.
absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text);

// Reads and parses a spec file; the error names the file.
absl::StatusOr<v1::JobSpec> LoadJobSpecFile(const std::string& path);

// Fills documented defaults in place (microbatch_size 64, activation relu...).
void ApplyJobSpecDefaults(v1::JobSpec& spec);

// Checks required fields, allowed values and ranges of a spec with defaults
// applied. Does not touch the file system: the coordinator checks the dataset.
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// Refuses a NaN or infinite value in any float or double field of `msg`,
// at any depth (repeated and map entries included), naming the field's path
// below `path` (e.g. "optimizer.learning_rate", "schedule.split[2]"). Every
// message that arrives from outside (specs, RPCs) goes through it.
absl::Status RequireFiniteFields(const google::protobuf::Message& msg,
                                 const std::string& path = "");

// The optimizer part of ValidateJobSpec (errors name optimizer.*), after
// defaults; workers check their assignment's optimizer with it too.
absl::Status ValidateOptimizerSpec(const v1::OptimizerSpec& optimizer);

// What each stage of a validated job is told, given the epoch length:
// its units (`ranges`, or the uniform partition when null), the model,
// optimizer and schedule, and the job's step counts resolved (total steps,
// T1's K and T3's W in steps; gpipe has no warm-up). Stage i's
// downstream_address is left empty.
// Optimizer steps in one epoch of `train_examples`: whole steps of N
// microbatches for each of schedule.replicas pipelines (0: the data make no
// full step).
int64_t StepsPerEpoch(int64_t train_examples, const v1::ScheduleSpec& schedule);
// T3's warm-up W in steps (warmup_steps, or warmup_epochs of
// `steps_per_epoch`); 0 for gpipe, which is synchronous throughout.
int64_t WarmupSteps(const v1::ScheduleSpec& schedule, int64_t steps_per_epoch);

absl::StatusOr<std::vector<v1::StageAssignment>> ResolveStageAssignments(
    const v1::JobSpec& spec, const std::string& job_id, int64_t steps_per_epoch,
    const std::vector<StageRange>* ranges = nullptr);

// A sequential model's model.units[i].type allowed values: the one list, for
// validation and for the model builder's errors. (model.type's:
// pipeline/core/settings.h.)
const std::vector<std::string>& LayerTypes();

// Number of pipeline units the model has: mlp layers - 1; resnet 3n + 2
// (stem, blocks, head); transformer_lm depth + 2 (embedding, blocks, norm and
// head); sequential its units; 0 for torchscript, whose count is known once
// the file is read (CountUnits in pipeline/model/model.h).
int ModelUnitCount(const v1::ModelSpec& model);

// The most pipeline units a model may have: each is a shape-pass step on the
// coordinator, a checkpoint file and a partition choice.
inline constexpr int kMaxModelUnits = 4096;

// Fills in what the zoo takes from the data, model.classes (classes, or the
// vocabulary for text) and transformer_lm's context (default data.context),
// plus the zoo's defaults (resnet depth 20, width 16; transformer_lm depth 2,
// width 128, heads 4), and checks them, naming the field. Other model types
// are left as they are.
absl::Status ResolveModel(v1::ModelSpec& model, int64_t classes, int64_t context);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_JOB_SPEC_H_
