// Unit tests of the client's views: what `pipemarectl status` prints.
#include "client/format.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"

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
                                "pipemare (synchronous warm-up, asynchronous from step 100)"));
}

}  // namespace
}  // namespace pipemare::client
