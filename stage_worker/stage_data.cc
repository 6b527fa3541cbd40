#include "stage_worker/stage_data.h"

#include "absl/strings/str_cat.h"
#include "pipeline/core/training.h"

namespace pipemare {

absl::StatusOr<std::unique_ptr<StageData>> StageData::Load(const v1::StageAssignment& a) {
  if (a.data().type().empty()) return std::unique_ptr<StageData>();
  const bool first = a.stage() == 0, last = a.stage() + 1 == a.num_stages();
  if (!first && !last) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: only stage 0 and the last stage read the job's data; this is stage ", a.stage()));
  }
  if (a.data_files().empty()) {
    return absl::InvalidArgumentError(
        "data_files: required with data (the coordinator's manifest of the files)");
  }
  if (auto st = CheckDataManifest(a.data(), a.data_files()); !st.ok()) return st;
  auto data = LoadData(a.data());
  if (!data.ok()) return data.status();
  std::unique_ptr<StageData> out(new StageData());
  out->data_ = *std::move(data);
  // Each end keeps only what it makes.
  for (Examples* split : {&out->data_.train, &out->data_.test}) {
    if (!first) {
      std::vector<float>().swap(split->inputs);
      std::vector<int64_t>().swap(split->tokens);
    }
    if (!last) std::vector<int64_t>().swap(split->targets);
  }
  out->train_ = a.train();
  out->epochs_ = a.train().epochs();
  out->max_train_count_ = a.schedule().microbatch_size();
  out->max_eval_count_ = EvalMicrobatchSize(a.schedule().microbatch_size());
  return out;
}

int64_t StageData::bytes() const {
  int64_t n = 0;
  for (const Examples* s : {&data_.train, &data_.test}) {
    n += static_cast<int64_t>(s->inputs.size() * sizeof(float) +
                              (s->tokens.size() + s->targets.size()) * sizeof(int64_t));
  }
  return n;
}

absl::StatusOr<Batch> StageData::Make(const v1::DataSlice& slice, v1::Phase phase, bool targets) {
  const bool train = phase == v1::TRAIN;
  if (!train && phase != v1::EVAL) {
    return absl::InvalidArgumentError("phase: a data slice is TRAIN or EVAL");
  }
  const Examples& split = train ? data_.train : data_.test;
  const int64_t max_count = train ? max_train_count_ : max_eval_count_;
  if (slice.count() < 1 || slice.count() > max_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.count: ", slice.count(), " examples; a microbatch has 1..", max_count));
  }
  if (slice.begin() < 0 || slice.begin() > split.count - slice.count()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.begin: examples [", slice.begin(), ", ", slice.begin() + slice.count(),
                     ") are outside the ", train ? "training" : "test", " split's ", split.count));
  }
  std::shared_ptr<const std::vector<int64_t>> order;
  if (train) {
    if (slice.epoch() < 1 || slice.epoch() > epochs_) {
      return absl::InvalidArgumentError(
          absl::StrCat("data.epoch: ", slice.epoch(), " is not in 1..", epochs_));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (order_epoch_ != slice.epoch()) {
      order_ = std::make_shared<const std::vector<int64_t>>(
          EpochOrder(split.count, train_, static_cast<int>(slice.epoch())));
      order_epoch_ = slice.epoch();
    }
    order = order_;
  }
  static const std::vector<int64_t> kInOrder;
  const std::vector<int64_t>& o = order ? *order : kInOrder;
  return targets ? GatherTargets(split, o, slice.begin(), slice.count())
                 : GatherInputs(split, o, slice.begin(), slice.count());
}

}  // namespace pipemare
