#include "client/simulate.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace pipemare::client {
namespace {

v1::JobSpec Spec(const std::string& type, int P, int N) {
  v1::JobSpec spec;
  spec.mutable_schedule()->set_type(type);
  spec.mutable_schedule()->set_stages(P);
  spec.mutable_schedule()->set_microbatches_per_step(N);
  return spec;
}

TEST(RenderSimulation, PrintsThePlanDelaysAndUtilizationAgainstGPipe) {
  SimulateOptions o;
  o.steps = 4;
  auto out = RenderSimulation(Spec("pipemare", 3, 1), o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "stage 0: 0F1 0F2 0F3 0B1 0U1 0F4 0B2 0U2 0B3 0U3 0B4 0U4"))
      << *out;
  EXPECT_TRUE(absl::StrContains(*out, "(N/(N+P-1) = 33.3%)")) << *out;
  EXPECT_TRUE(absl::StrContains(*out, "throughput")) << *out;
}

TEST(RenderSimulation, GPipeMatchesItsFormula) {
  SimulateOptions o;
  o.steps = 10;
  auto out = RenderSimulation(Spec("gpipe", 4, 4), o);
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE(absl::StrContains(*out,
                                "predicted mean utilization 57.1%; gpipe on the same "
                                "pipeline 57.1% (N/(N+P-1) = 57.1%); throughput 1.00x"))
      << *out;
}

TEST(RenderSimulation, BadOptionsNameTheFlag) {
  SimulateOptions o;
  o.steps = 0;
  auto out = RenderSimulation(Spec("pipemare", 2, 1), o);
  ASSERT_FALSE(out.ok());
  EXPECT_TRUE(absl::StrContains(out.status().message(), "--steps"));
}

}  // namespace
}  // namespace pipemare::client
