// Unit tests of the client's views: what `pipemarectl status` prints.
#include "client/format.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pipemare::client {
namespace {

TEST(FormatBytes, BinaryUnits) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(12 * 1024 * 1024), "12.0 MiB");
  EXPECT_EQ(FormatBytes(3 * 1024LL * 1024 * 1024 + 256LL * 1024 * 1024), "3.25 GiB");
}

TEST(RenderJobStatus, ShowsPeakMemoryPerStageAndTheTotal) {
  v1::JobStatus job;
  job.set_id("job-1");
  job.set_state(v1::RUNNING);
  for (int i = 0; i < 2; ++i) {
    auto* s = job.add_stages();
    s->set_index(i);
    s->set_analytic_delay(1 - i);
    s->set_measured_delay(1 - i);
    auto* peak = s->mutable_peak_memory();
    peak->set_weights(1024 * 1024);
    peak->set_optimizer_state(1024 * 1024);
    peak->set_stash(i == 0 ? 2 * 1024 * 1024 : 0);
    peak->set_saved_activations(64 * 1024);
  }
  const std::string out = RenderJobStatus(job);
  EXPECT_TRUE(absl::StrContains(out, "WEIGHTS+OPT")) << out;
  EXPECT_TRUE(absl::StrContains(out, "4.00 MiB")) << out;  // stage 0: weights, momentum, stash
  EXPECT_TRUE(absl::StrContains(out, "2.00 MiB")) << out;  // stage 1
  EXPECT_TRUE(absl::StrContains(out, "64.0 KiB")) << out;  // saved inputs
  EXPECT_TRUE(absl::StrContains(out, "all stages: 6.00 MiB")) << out;
}

TEST(RenderJobStatus, ShowsTheWarmupSwitch) {
  v1::JobStatus job;
  job.set_schedule("pipemare");
  job.mutable_spec()->mutable_schedule()->set_type("pipemare");
  job.mutable_spec()->mutable_schedule()->set_warmup_steps(100);
  job.add_stages()->set_async_from_step(-1);
  EXPECT_TRUE(absl::StrContains(RenderJobStatus(job), "pipemare (synchronous warm-up)"));
  job.mutable_stages(0)->set_async_from_step(100);
  EXPECT_TRUE(absl::StrContains(RenderJobStatus(job),
                                "pipemare (synchronous warm-up, asynchronous from step 100); "
                                "backward recomputes the forward"));
  job.set_schedule("zero_bubble");
  job.mutable_spec()->mutable_schedule()->set_type("zero_bubble");
  EXPECT_TRUE(
      absl::StrContains(RenderJobStatus(job), "zero_bubble; backward uses the forward's graph"));
}

// The stages table's line for stage `index` (starts with the index, right
// aligned), or "" if there is none.
std::string StageLine(const std::string& out, int index) {
  const std::vector<std::string> lines = absl::StrSplit(out, '\n');
  bool in_table = false;
  for (const std::string& line : lines) {
    if (absl::StartsWith(line, "STAGE")) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    if (line.empty()) break;
    std::vector<std::string> cells = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (!cells.empty() && cells[0] == std::to_string(index)) return line;
  }
  return "";
}

v1::JobStatus ProfiledJob() {
  v1::JobStatus job;
  job.set_id("job-7");
  job.set_state(v1::RUNNING);
  job.set_partition("profile");
  const int first[] = {0, 5, 6};
  const int units[] = {5, 1, 3};
  const int64_t params[] = {1200, 48120, 850};
  const double seconds[] = {0.0021, 0.0043, 0.0019};
  for (int i = 0; i < 3; ++i) {
    auto* s = job.add_stages();
    s->set_index(i);
    s->set_worker_id(absl::StrCat("w", i));
    s->set_first_unit(first[i]);
    s->set_units(units[i]);
    s->set_parameters(params[i]);
    s->set_predicted_seconds(seconds[i]);
    s->set_bottleneck(i == 1);
  }
  return job;
}

TEST(RenderJobStatus, ShowsThePartitionAndPredictedCostsAndTheBottleneck) {
  const std::string out = RenderJobStatus(ProfiledJob());
  EXPECT_TRUE(absl::StrContains(out, "PARTITION")) << out;
  EXPECT_TRUE(absl::StrContains(out, "profile")) << out;
  EXPECT_TRUE(absl::StrContains(out, "PREDICTED")) << out;

  const std::string s0 = StageLine(out, 0), s1 = StageLine(out, 1), s2 = StageLine(out, 2);
  EXPECT_TRUE(absl::StrContains(s0, "0..4")) << out;
  EXPECT_TRUE(absl::StrContains(s0, "1200")) << out;
  EXPECT_TRUE(absl::StrContains(s0, "2.10 ms")) << out;
  EXPECT_FALSE(absl::StrContains(s0, "bottleneck")) << out;
  EXPECT_TRUE(absl::StrContains(s1, "w1")) << out;
  EXPECT_TRUE(absl::StrContains(s1, "48120")) << out;
  EXPECT_TRUE(absl::StrContains(s1, "4.30 ms")) << out;
  EXPECT_TRUE(absl::EndsWith(s1, "<- bottleneck")) << out;
  EXPECT_TRUE(absl::StrContains(s2, "6..8")) << out;
  EXPECT_TRUE(absl::StrContains(s2, "1.90 ms")) << out;
  EXPECT_FALSE(absl::StrContains(s2, "bottleneck")) << out;
  // One marked stage in all.
  EXPECT_EQ(out.find("bottleneck"), out.rfind("bottleneck")) << out;
}

TEST(RenderJobStatus, NoPredictedColumnWithoutPredictions) {
  v1::JobStatus job = ProfiledJob();
  job.set_partition("parameters");
  for (auto& s : *job.mutable_stages()) s.set_predicted_seconds(0);
  const std::string out = RenderJobStatus(job);
  EXPECT_TRUE(absl::StrContains(out, "parameters")) << out;
  EXPECT_FALSE(absl::StrContains(out, "PREDICTED")) << out;
  EXPECT_FALSE(absl::StrContains(out, " ms")) << out;
  EXPECT_TRUE(absl::EndsWith(StageLine(out, 1), "<- bottleneck")) << out;
  // The header has no trailing blanks for the marker column.
  for (const auto& line : std::vector<std::string>(absl::StrSplit(out, '\n'))) {
    EXPECT_FALSE(absl::EndsWith(line, " ")) << "'" << line << "'";
  }
}

TEST(RenderJobStatus, PartitionRowOnlyWhenSetAndSplitPointsShown) {
  v1::JobStatus job = ProfiledJob();
  job.clear_partition();
  EXPECT_FALSE(absl::StrContains(RenderJobStatus(job), "PARTITION"));
  job.set_partition("split");
  job.mutable_spec()->mutable_schedule()->add_split(5);
  job.mutable_spec()->mutable_schedule()->add_split(6);
  EXPECT_TRUE(absl::StrContains(RenderJobStatus(job), "split (stages start at units 0, 5, 6)"))
      << RenderJobStatus(job);
}

v1::JobStatus FinishedJob(const std::string& task) {
  v1::JobStatus job;
  job.set_id("job-9");
  job.set_state(v1::SUCCEEDED);
  job.set_task(task);
  job.mutable_progress()->set_epoch(2);
  job.mutable_progress()->set_epochs(2);
  job.mutable_progress()->set_step(10);
  job.mutable_progress()->set_total_steps(10);
  job.mutable_metrics()->set_test_accuracy(0.4321);
  job.mutable_metrics()->set_test_loss(2.5);
  job.mutable_metrics()->set_test_perplexity(12.1825);
  for (int e = 1; e <= 2; ++e) {
    auto* r = job.add_epochs();
    r->set_epoch(e);
    r->set_test_accuracy(e == 1 ? 0.30 : 0.4321);
    r->set_test_perplexity(e == 1 ? 30.5 : 12.1825);
  }
  return job;
}

TEST(RenderJobStatus, LanguageModelsShowPerplexityAndTokenAccuracy) {
  const std::string out = RenderJobStatus(FinishedJob("language_model"));
  EXPECT_TRUE(absl::StrContains(out, "token accuracy 43.2%, test perplexity 12.18")) << out;
  EXPECT_TRUE(absl::StrContains(out, "TOKEN-ACC")) << out;
  EXPECT_TRUE(absl::StrContains(out, "TEST-PPL")) << out;
  EXPECT_TRUE(absl::StrContains(out, "30.50")) << out;
  EXPECT_FALSE(absl::StrContains(out, "test accuracy")) << out;

  const std::string line = RenderProgressLine(FinishedJob("language_model"), false);
  EXPECT_TRUE(absl::StrContains(line, "token acc 43.2%  ppl 12.18")) << line;
}

TEST(RenderJobStatus, ClassifiersShowNoPerplexity) {
  // Even if a perplexity were reported, a classifier shows plain accuracy.
  for (const char* task : {"classification", ""}) {
    const std::string out = RenderJobStatus(FinishedJob(task));
    EXPECT_TRUE(absl::StrContains(out, "test accuracy 43.2%,")) << out;
    EXPECT_TRUE(absl::StrContains(out, "TEST-ACC")) << out;
    EXPECT_FALSE(absl::StrContains(out, "perplexity")) << out;
    EXPECT_FALSE(absl::StrContains(out, "PPL")) << out;
    EXPECT_FALSE(absl::StrContains(out, "token")) << out;
    EXPECT_FALSE(absl::StrContains(RenderProgressLine(FinishedJob(task), false), "ppl"));
  }
  // A language model before its first perplexity: token accuracy, no PPL.
  v1::JobStatus lm = FinishedJob("language_model");
  lm.mutable_metrics()->set_test_perplexity(0);
  for (auto& e : *lm.mutable_epochs()) e.set_test_perplexity(0);
  const std::string out = RenderJobStatus(lm);
  EXPECT_TRUE(absl::StrContains(out, "token accuracy 43.2%, 0 samples/s")) << out;
  EXPECT_FALSE(absl::StrContains(out, "PPL")) << out;
}

}  // namespace
}  // namespace pipemare::client

namespace pipemare::client {
namespace {

// A resume from a cut inside epoch 1 takes epoch 1's result back and reports
// it again at its end: a watch prints each epoch once.
TEST(ProgressPrinter, PrintsEachEpochOnceAcrossAResume) {
  FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    ProgressPrinter printer(out, /*live=*/false);
    v1::JobStatus job;
    job.set_id("job-1");
    job.set_state(v1::RUNNING);
    job.mutable_progress()->set_epoch(1);
    job.mutable_progress()->set_epochs(3);
    printer.Update(job);
    job.add_epochs()->set_epoch(1);
    printer.Update(job);
    job.clear_epochs();  // resumed from a cut inside epoch 1
    job.set_state(v1::PENDING);
    printer.Update(job);
    job.set_state(v1::RUNNING);
    printer.Update(job);
    job.add_epochs()->set_epoch(1);
    printer.Update(job);
    job.add_epochs()->set_epoch(2);
    printer.Update(job);
  }
  std::rewind(out);
  std::string text;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), out)) > 0;) text.append(buffer, n);
  std::fclose(out);
  int ones = 0, twos = 0;
  for (const auto& line : absl::StrSplit(text, '\n')) {
    ones += absl::StrContains(line, "epoch 1/3 done");
    twos += absl::StrContains(line, "epoch 2/3 done");
  }
  EXPECT_EQ(ones, 1) << text;
  EXPECT_EQ(twos, 1) << text;
}

}  // namespace
}  // namespace pipemare::client
