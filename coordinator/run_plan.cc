#include "coordinator/run_plan.h"

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/schedule.h"
#include "pipeline/core/settings.h"

namespace pipemare {
namespace {

// Cuts the model into `P` stages by schedule.partition.
absl::Status Partition(const v1::JobSpec& spec, const ModelPlan& plan, int P,
                       const ProfileUnits& profile, RunPlan* run) {
  const auto& sched = spec.schedule();
  const PartitionKind kind = PartitionOf(sched.partition());
  run->partition = PartitionName(kind);
  const int units = static_cast<int>(plan.units.size());
  std::vector<double> params;
  for (const auto& u : plan.units) params.push_back(static_cast<double>(u.parameters));
  absl::StatusOr<std::vector<StageRange>> ranges;
  if (kind == PartitionKind::kProfile) {
    auto cost = profile(plan);
    if (!cost.ok()) return cost.status();
    ranges = PartitionByCost(*cost, P);
    if (ranges.ok()) run->predicted_seconds = StageCosts(*ranges, *cost);
  } else if (kind == PartitionKind::kParameters) {
    std::vector<int64_t> exact;  // integer arithmetic: exact ties
    for (const auto& u : plan.units) exact.push_back(u.parameters);
    ranges = PartitionByParameters(exact, P);
  } else if (kind == PartitionKind::kSplit) {
    ranges = PartitionFromSplit({sched.split().begin(), sched.split().end()}, units, P);
  } else {
    ranges = PartitionUniform(units, P);
  }
  if (!ranges.ok()) return ranges.status();
  run->ranges = *std::move(ranges);
  run->stage_parameters = StageCosts(run->ranges, {params});
  std::vector<double> by = run->predicted_seconds;
  if (kind == PartitionKind::kParameters) by = run->stage_parameters;
  if (by.empty()) {
    for (const auto& r : run->ranges) by.push_back(r.units);
  }
  run->bottleneck = Bottleneck(by);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RunPlan> MakeRunPlan(const v1::JobSpec& spec, const std::string& job_id,
                                    int64_t generation, const std::string& checkpoint_dir,
                                    int64_t max_model_bytes, const ProfileUnits& profile,
                                    const google::protobuf::RepeatedPtrField<v1::DataFile>& first) {
  const auto& sched = spec.schedule();
  const int P = sched.stages();
  const int N = sched.microbatches_per_step();
  const int64_t mbs = sched.microbatch_size();
  RunPlan run;
  auto data = LoadData(spec.data());
  if (!data.ok()) return absl::InvalidArgumentError(data.status().message());
  run.data = std::move(*data);
  auto plan = PlanModel(spec, run.data.info, max_model_bytes);
  if (!plan.ok()) return absl::InvalidArgumentError(plan.status().message());
  run.lm = run.data.info.task == Task::kLanguageModel;
  if (auto st = Partition(spec, *plan, P, profile, &run); !st.ok()) return st;
  run.steps_per_epoch = StepsPerEpoch(run.data.train.count, sched);
  if (run.steps_per_epoch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.train_limit: ", run.data.train.count, " training examples make no full step of ", N,
        " microbatches of ", mbs, "; use more data or smaller schedule.microbatch_size"));
  }
  run.total_steps = run.steps_per_epoch * spec.train().epochs();
  v1::JobSpec resolved = spec;
  *resolved.mutable_model() = plan->model;
  auto assignments = ResolveStageAssignments(resolved, job_id, run.steps_per_epoch, &run.ranges);
  if (!assignments.ok()) return assignments.status();
  CutCommitter::Run& cuts = run.cuts;
  cuts.job_id = job_id;
  cuts.generation = generation;
  cuts.dir = spec.checkpoint().dir().empty() ? checkpoint_dir : spec.checkpoint().dir();
  cuts.every_steps = spec.checkpoint().every_steps();
  cuts.keep = spec.checkpoint().keep();
  cuts.steps_per_epoch = run.steps_per_epoch;
  cuts.microbatches_per_step = N;
  cuts.microbatch_size = mbs;
  cuts.seed = spec.train().seed();
  cuts.ranges = run.ranges;
  {
    google::protobuf::util::JsonPrintOptions json;
    json.preserve_proto_field_names = true;  // as the spec files spell them
    // Cannot fail for a valid message; an empty spec would only leave the
    // manifest without it.
    (void)google::protobuf::util::MessageToJsonString(resolved, &cuts.spec_json, json);
  }
  {
    std::string shape, channels;
    for (int64_t dim : plan->input.shape) absl::StrAppend(&shape, shape.empty() ? "" : ",", dim);
    for (const auto& c : run.data.channels) {
      absl::StrAppend(&channels, channels.empty() ? "" : ",", "{\"mean\":", c.mean,
                      ",\"std\":", c.std, "}");
    }
    cuts.input_json =
        absl::StrCat("{\"shape\":[", shape, "],\"tokens\":", plan->input.tokens ? "true" : "false",
                     ",\"normalisation\":[", channels, "]}");
  }
  for (auto& a : *assignments) {
    a.set_checkpoint_dir(cuts.dir);
    a.set_generation(generation);
    for (int64_t dim : plan->units[a.first_unit()].in.shape) a.add_input_shape(dim);
    for (int64_t dim : plan->units[a.first_unit() + a.units() - 1].out.shape) {
      a.add_output_shape(dim);
    }
    a.set_token_input(plan->units[a.first_unit()].in.tokens);
    a.set_torchscript(plan->torchscript);
  }
  // Stage 0 and the last stage read the examples themselves, from the same
  // files: the manifest is what they check their copies against. After the
  // first run it must be the job's data as that run read it.
  auto manifest = ManifestOfData(spec.data());
  if (!manifest.ok()) return absl::InvalidArgumentError(manifest.status().message());
  if (!first.empty()) {
    if (auto st = CheckDataUnchanged(*manifest, first); !st.ok()) return st;
  }
  for (v1::StageAssignment* a : {&assignments->front(), &assignments->back()}) {
    *a->mutable_data() = spec.data();
    *a->mutable_train() = spec.train();
    a->mutable_data_files()->Assign(manifest->begin(), manifest->end());
  }
  run.warmup_steps = assignments->front().warmup_steps();
  // The schedule as data: refuse a plan that cannot run before any stage loads.
  PlanOptions options{ScheduleKindOf(sched), P, N, run.steps_per_epoch, 0, run.warmup_steps};
  auto built = BuildPlan(options);
  absl::Status valid = built.ok() ? ValidatePlan(*built) : built.status();
  if (!valid.ok()) return valid;
  run.assignments = *std::move(assignments);
  return run;
}

void AddRestoreFiles(const Manifest& m, std::vector<v1::StageAssignment>& assignments) {
  for (auto& a : assignments) {
    for (const auto& f : m.files) {
      if (f.unit < a.first_unit() || f.unit >= a.first_unit() + a.units()) continue;
      auto* file = a.add_restore();
      file->set_unit(f.unit);
      file->set_path(f.path);
      file->set_bytes(f.bytes);
      file->set_sha256(f.sha256);
    }
  }
}

}  // namespace pipemare
