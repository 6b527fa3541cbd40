// Checkpoint files and manifests (pipeline/core/checkpoint.h): a stage's cut
// taken by its executor, written per unit, committed, verified, exported,
// and damage of every kind detected.
#include "pipeline/core/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "pipeline/model/checkpoint_units.h"
#include "pipeline/runtime/stage_executor.h"

namespace pipemare {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int64_t kBatch = 4;

// Stage `stage` of 2 of the MLP [4, 3, 2] (one unit each), pipemare with T2
// and SGD momentum, one step an epoch, checkpoints after every step.
v1::StageAssignment Assignment(int stage) {
  v1::StageAssignment a;
  a.set_job_id("job-7");
  a.set_stage(stage);
  a.set_num_stages(2);
  a.set_first_unit(stage);
  a.set_units(1);
  a.mutable_model()->set_type("mlp");
  for (int64_t w : {4, 3, 2}) a.mutable_model()->add_layers(w);
  a.mutable_optimizer()->set_type("sgd");
  a.mutable_optimizer()->set_lr(0.1);
  a.mutable_optimizer()->set_momentum(0.9);
  a.mutable_schedule()->set_type("pipemare");
  a.mutable_schedule()->set_stages(2);
  a.mutable_schedule()->set_microbatch_size(kBatch);
  a.mutable_schedule()->set_microbatches_per_step(1);
  a.mutable_schedule()->set_discrepancy_decay(0.5);
  a.set_steps_per_epoch(1);
  a.set_total_steps(3);
  a.set_checkpoint_every_steps(1);
  a.set_seed(5);
  return a;
}

std::string TempDir() {
  std::string pattern = (fs::temp_directory_path() / "pipemare-ckpt-XXXXXX").string();
  return mkdtemp(pattern.data());
}

// Trains both stages of the 2-stage job one step through their executors
// (stage 0: F1; stage 1: F1 B1 U1; stage 0: B1 U1) and returns each stage's
// snapshot of the cut after step 1.
std::vector<std::shared_ptr<const StageSnapshot>> TrainOneStep(
    std::vector<std::unique_ptr<StageRuntime>>* runtimes) {
  std::vector<std::shared_ptr<const StageSnapshot>> cuts(2);
  std::vector<std::optional<StageExecutor>> ex(2);
  for (int i = 0; i < 2; ++i) {
    runtimes->push_back(std::move(*StageRuntime::Create(Assignment(i))));
    ex[i].emplace(std::move(*StageExecutor::Create(Assignment(i), (*runtimes)[i].get())));
  }
  torch::manual_seed(1);
  auto a = ex[0]->Forward(1, torch::randn({kBatch, 4}));
  EXPECT_TRUE(a.ok());
  EXPECT_TRUE(ex[1]->Forward(1, a->tensor, torch::randint(0, 2, {kBatch})).ok());
  torch::Tensor grad;
  for (int i : {1, 0}) {
    if (i == 0) EXPECT_TRUE(ex[0]->Backward(1, grad).ok());
    for (;;) {
      auto out = ex[i]->RunLocal();
      EXPECT_TRUE(out.ok());
      if (!out->has_value()) break;
      if ((*out)->action.op == Action::Op::kBackward) grad = (*out)->tensor;
      if ((*out)->snapshot) cuts[i] = (*out)->snapshot;
    }
  }
  return cuts;
}

TEST(CheckpointTest, TheCutHoldsEachUnitsWeightsOptimizerStateAndVelocity) {
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  auto cuts = TrainOneStep(&runtimes);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(cuts[i]) << "stage " << i << " cut after step 1";
    EXPECT_EQ(cuts[i]->step, 1);
    ASSERT_EQ(cuts[i]->units.size(), 1u);
    EXPECT_EQ(cuts[i]->units[0].unit, i);  // the unit's index in the whole model
    std::map<std::string, torch::Tensor> t(cuts[i]->units[0].tensors.begin(),
                                           cuts[i]->units[0].tensors.end());
    const std::string linear = "seq.0";  // each unit: Linear [activation]
    ASSERT_TRUE(t.count("param/" + linear + ".weight")) << "stage " << i;
    EXPECT_TRUE(t.count("optim/" + linear + ".weight/momentum_buffer"));
    // T2's δ where τ_i >= 1: stage 0 of 2, not the last stage.
    EXPECT_EQ(t.count("t2/" + linear + ".weight"), i == 0 ? 1u : 0u);
    // A copy of the weights after step 1, not a view of the live ones.
    EXPECT_TRUE(torch::equal(t["param/" + linear + ".weight"], runtimes[i]->Parameters()[0]));
    EXPECT_NE(t["param/" + linear + ".weight"].data_ptr(), runtimes[i]->Parameters()[0].data_ptr());
  }
}

TEST(CheckpointTest, CommittedCutsVerifyExportAndDamageIsDetected) {
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  auto cuts = TrainOneStep(&runtimes);
  const std::string dir = TempDir();
  Manifest m;
  m.job = "job-7";
  m.step = 1;
  m.stages = {{0, 1}, {1, 1}};
  m.spec_json = R"({"name": "x"})";
  m.input_json = R"({"shape": ["4"]})";
  for (int i = 0; i < 2; ++i) {
    auto files = WriteStageSnapshot(dir, "job-7", *cuts[i]);
    ASSERT_TRUE(files.ok()) << files.status();
    m.files.insert(m.files.end(), files->begin(), files->end());
  }
  // Every unit once, or nothing is committed.
  Manifest partial = m;
  partial.files.pop_back();
  EXPECT_THAT(std::string(CommitManifest(dir, partial, 2).message()), HasSubstr("1 of 2 units"));
  EXPECT_FALSE(fs::exists(dir + "/job-7/latest"));
  ASSERT_TRUE(CommitManifest(dir, m, 2).ok());
  auto read = NewestValidManifest(dir, "job-7");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->step, 1);
  EXPECT_EQ(read->files.size(), 2u);

  // Export: nn.Sequential(unit_0, unit_1) names, the trained weights.
  auto model = ExportModel(CheckpointStepDir(dir, "job-7", 1), *read, "");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->format, "state_dict");
  c10::Dict<c10::IValue, c10::IValue> dict =
      torch::pickle_load(std::vector<char>(model->bytes.begin(), model->bytes.end()))
          .toGenericDict();
  std::vector<std::string> keys;
  for (const auto& item : dict) keys.push_back(item.key().toStringRef());
  EXPECT_THAT(keys,
              ::testing::UnorderedElementsAre("0.0.weight", "0.0.bias", "1.0.weight", "1.0.bias"));
  EXPECT_TRUE(torch::equal(dict.at("1.0.weight").toTensor(), runtimes[1]->Parameters()[0]));

  // A second cut, then damage to it: truncation, a flipped byte, a manifest
  // from another cut. Each is refused naming what is wrong, and the newest
  // valid cut is the previous one.
  StageSnapshot later0 = *cuts[0], later1 = *cuts[1];
  later0.step = later1.step = 2;
  Manifest m2 = m;
  m2.step = 2;
  m2.files.clear();
  for (const auto* cut : {&later0, &later1}) {
    auto files = WriteStageSnapshot(dir, "job-7", *cut);
    ASSERT_TRUE(files.ok());
    m2.files.insert(m2.files.end(), files->begin(), files->end());
  }
  ASSERT_TRUE(CommitManifest(dir, m2, 2).ok());
  const std::string step2 = CheckpointStepDir(dir, "job-7", 2);
  const std::string unit1 = step2 + "/unit-00001.pt";
  const auto size = fs::file_size(unit1);
  {
    std::fstream f(unit1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size / 2));
    f.put('\x5a');
  }
  auto flipped = ReadManifest(step2);
  EXPECT_EQ(flipped.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(flipped.status().message()), HasSubstr("unit-00001.pt: SHA-256"));
  fs::resize_file(unit1, size / 2);
  EXPECT_THAT(std::string(ReadManifest(step2).status().message()),
              HasSubstr("truncated or overwritten"));
  std::vector<std::string> skipped;
  auto newest = NewestValidManifest(dir, "job-7", &skipped);
  ASSERT_TRUE(newest.ok());
  EXPECT_EQ(newest->step, 1);
  ASSERT_EQ(skipped.size(), 1u);
  // Mixed generations: step 2's manifest copied over step 1's.
  fs::copy_file(step2 + "/manifest.json", CheckpointStepDir(dir, "job-7", 1) + "/manifest.json",
                fs::copy_options::overwrite_existing);
  EXPECT_THAT(std::string(ReadManifest(CheckpointStepDir(dir, "job-7", 1)).status().message()),
              HasSubstr("a manifest of another cut"));
  EXPECT_EQ(NewestValidManifest(dir, "job-7").status().code(), absl::StatusCode::kNotFound);
  fs::remove_all(dir);
}

TEST(CheckpointTest, AUnitReadBackSerialisesToItsFilesVeryBytes) {
  // Live recovery with replicas checks a unit sent from another replica's
  // memory against the file's SHA-256: the state a file was read into (or a
  // replica's copy of it) must serialise to exactly that file again.
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  auto cuts = TrainOneStep(&runtimes);
  const std::string dir = TempDir();
  for (const auto& cut : cuts) {
    auto files = WriteStageSnapshot(dir, "job-8", *cut);
    ASSERT_TRUE(files.ok()) << files.status();
    for (size_t i = 0; i < files->size(); ++i) {
      const WrittenFile& f = (*files)[i];
      auto held = UnitFileBytes(cut->units[i], cut->step);
      ASSERT_TRUE(held.ok());
      EXPECT_EQ(Sha256Hex(*held), f.sha256) << "the snapshot it was written from";
      auto read = ReadUnitFile(f.path, f.sha256);
      ASSERT_TRUE(read.ok()) << read.status();
      auto again = UnitFileBytes(*read, cut->step);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ(Sha256Hex(*again), f.sha256) << "the state read back from the file";
      auto parsed = ParseUnitFile(*again, f.sha256, "a replica's copy");
      ASSERT_TRUE(parsed.ok()) << parsed.status();
      EXPECT_EQ(parsed->unit, f.unit);
      // Any other bytes are refused, naming where they came from.
      EXPECT_THAT(
          std::string(
              ParseUnitFile(again->substr(1), f.sha256, "a replica's copy").status().message()),
          HasSubstr("a replica's copy: SHA-256 does not match"));
    }
  }
}

TEST(CheckpointTest, KeepsTheNewestCommittedCuts) {
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  auto cuts = TrainOneStep(&runtimes);
  const std::string dir = TempDir();
  for (int64_t step : {1, 2, 3, 4}) {
    Manifest m;
    m.job = "job-7";
    m.step = step;
    m.stages = {{0, 1}, {1, 1}};
    for (int i = 0; i < 2; ++i) {
      StageSnapshot s = *cuts[i];
      s.step = step;
      auto files = WriteStageSnapshot(dir, "job-7", s);
      ASSERT_TRUE(files.ok());
      m.files.insert(m.files.end(), files->begin(), files->end());
    }
    ASSERT_TRUE(CommitManifest(dir, m, 2).ok());
  }
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir + "/job-7")) {
    left.push_back(e.path().filename().string());
  }
  EXPECT_THAT(left, ::testing::UnorderedElementsAre("step-3", "step-4", "latest"));
  fs::remove_all(dir);
}

TEST(CheckpointTest, AnOlderGenerationCanNeitherOverwriteFilesNorMoveLatestBack) {
  // Fencing: generation 2 (a recovered run) committed step 2; a stage of
  // generation 1 (cut off, then back) writes the same cut's units and its
  // coordinator tries to commit them.
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  auto cuts = TrainOneStep(&runtimes);
  const std::string dir = TempDir();
  auto commit = [&](int64_t generation) {
    Manifest m;
    m.job = "job-7";
    m.generation = generation;
    m.step = 2;
    m.stages = {{0, 1}, {1, 1}};
    for (int i = 0; i < 2; ++i) {
      StageSnapshot s = *cuts[i];
      s.step = 2;
      s.generation = generation;
      auto files = WriteStageSnapshot(dir, "job-7", s);
      EXPECT_TRUE(files.ok());
      if (files.ok()) m.files.insert(m.files.end(), files->begin(), files->end());
    }
    return std::make_pair(m, CommitManifest(dir, m, 2));
  };
  auto [newer, ok] = commit(2);
  ASSERT_TRUE(ok.ok()) << ok;
  EXPECT_THAT(newer.files[0].path, ::testing::EndsWith("/step-2/unit-00000.g2.pt"));
  auto [older, fenced] = commit(1);
  EXPECT_EQ(fenced.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(fenced.message()), HasSubstr("generation 2, newer than this run's 1"));
  // Generation 2's cut is intact and still "latest".
  auto read = NewestValidManifest(dir, "job-7");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->generation, 2);
  EXPECT_EQ(read->files[0].path, newer.files[0].path);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pipemare
