#include "pipeline/core/job_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipeline/core/schedule.h"
#include "pipeline/core/settings.h"

namespace pipemare {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr const char* kYamlSpec = R"(
name: mnist-pipemare
model:
  type: mlp
  layers: [784, 512, 512, 256, 10]
  activation: relu
data:
  type: mnist
  path: data/mnist
optimizer:
  type: sgd
  lr: 0.05
  momentum: 0.9
schedule:
  type: pipemare
  stages: 4
  microbatch_size: 64
  microbatches_per_step: 1
  lr_anneal_steps: 2000
  discrepancy_decay: 0.1
train:
  epochs: 2
  seed: 1
)";

constexpr const char* kJsonSpec = R"({
  "name": "mnist-pipemare",
  "model": {"type": "mlp", "layers": [784, 512, 512, 256, 10], "activation": "relu"},
  "data": {"type": "mnist", "path": "data/mnist"},
  "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
  "schedule": {"type": "pipemare", "stages": 4, "microbatch_size": 64,
               "microbatches_per_step": 1, "lr_anneal_steps": 2000,
               "discrepancy_decay": 0.1},
  "train": {"epochs": 2, "seed": 1}
})";

void ExpectExampleSpec(const v1::JobSpec& spec) {
  EXPECT_EQ(spec.name(), "mnist-pipemare");
  EXPECT_EQ(spec.model().type(), "mlp");
  ASSERT_EQ(spec.model().layers_size(), 5);
  EXPECT_EQ(spec.model().layers(0), 784);
  EXPECT_EQ(spec.model().layers(1), 512);
  EXPECT_EQ(spec.model().layers(2), 512);
  EXPECT_EQ(spec.model().layers(3), 256);
  EXPECT_EQ(spec.model().layers(4), 10);
  EXPECT_EQ(spec.model().activation(), "relu");
  EXPECT_EQ(spec.data().type(), "mnist");
  EXPECT_EQ(spec.data().path(), "data/mnist");
  EXPECT_EQ(spec.data().train_limit(), 0);
  EXPECT_EQ(spec.data().test_limit(), 0);
  EXPECT_EQ(spec.optimizer().type(), "sgd");
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 0.05);
  EXPECT_DOUBLE_EQ(spec.optimizer().momentum(), 0.9);
  EXPECT_DOUBLE_EQ(spec.optimizer().weight_decay(), 0.0);
  EXPECT_FALSE(spec.optimizer().nesterov());
  EXPECT_EQ(spec.schedule().type(), "pipemare");
  EXPECT_EQ(spec.schedule().stages(), 4);
  EXPECT_EQ(spec.schedule().microbatch_size(), 64);
  EXPECT_EQ(spec.schedule().microbatches_per_step(), 1);
  EXPECT_EQ(spec.schedule().lr_anneal_steps(), 2000);
  EXPECT_DOUBLE_EQ(spec.schedule().lr_anneal_epochs(), 0.0);
  ASSERT_TRUE(spec.schedule().has_discrepancy_decay());
  EXPECT_DOUBLE_EQ(spec.schedule().discrepancy_decay(), 0.1);
  EXPECT_EQ(spec.train().epochs(), 2);
  EXPECT_EQ(spec.train().seed(), 1);
}

v1::JobSpec ValidSpec() {
  auto spec = ParseJobSpec(kYamlSpec);
  EXPECT_TRUE(spec.ok()) << spec.status();
  ApplyJobSpecDefaults(*spec);
  return *spec;
}

// Applies `mutate` to the valid example (after defaults) and validates it.
absl::Status ValidateMutated(const std::function<void(v1::JobSpec&)>& mutate) {
  v1::JobSpec spec = ValidSpec();
  mutate(spec);
  return ValidateJobSpec(spec);
}

// Parses `yaml`, applies defaults and validates.
absl::Status ParseAndValidate(const std::string& yaml) {
  auto spec = ParseJobSpec(yaml);
  if (!spec.ok()) return spec.status();
  ApplyJobSpecDefaults(*spec);
  return ValidateJobSpec(*spec);
}

void ExpectInvalid(const absl::Status& st, const std::string& path, const std::string& hint) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr(path), HasSubstr(hint)));
}

TEST(JobSpecParseTest, ParsesFullYamlSpec) {
  auto spec = ParseJobSpec(kYamlSpec);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ExpectExampleSpec(*spec);
  EXPECT_FALSE(spec->train().has_shuffle());
  ApplyJobSpecDefaults(*spec);
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
}

TEST(JobSpecParseTest, ParsesFullJsonSpec) {
  auto spec = ParseJobSpec(kJsonSpec);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ExpectExampleSpec(*spec);
  ApplyJobSpecDefaults(*spec);
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
}

TEST(JobSpecParseTest, YamlAndJsonGiveTheSameMessage) {
  auto yaml = ParseJobSpec(kYamlSpec);
  auto json = ParseJobSpec(kJsonSpec);
  ASSERT_TRUE(yaml.ok() && json.ok());
  EXPECT_EQ(yaml->SerializeAsString(), json->SerializeAsString());
}

TEST(JobSpecParseTest, ParsesExampleFlowStyleFile) {
  const std::string path = testing::TempDir() + "/job_spec_test_example.yaml";
  {
    std::ofstream out(path);
    out << "name: mnist-pipemare\n"
           "model: {type: mlp, layers: [784, 512, 512, 256, 10], activation: relu}\n"
           "data: {type: mnist, path: data/mnist}\n"
           "optimizer: {type: sgd, lr: 0.05, momentum: 0.9}\n"
           "schedule: {type: pipemare, stages: 4, microbatch_size: 64, microbatches_per_step: 1,\n"
           "           lr_anneal_steps: 2000, discrepancy_decay: 0.1}\n"
           "train: {epochs: 2, seed: 1}\n";
  }
  auto spec = LoadJobSpecFile(path);
  std::remove(path.c_str());
  ASSERT_TRUE(spec.ok()) << spec.status();
  ExpectExampleSpec(*spec);
}

TEST(JobSpecParseTest, LoadMissingFileIsNotFoundNamingTheFile) {
  const std::string path = testing::TempDir() + "/no-such-spec-file.yaml";
  auto spec = LoadJobSpecFile(path);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr(path));
}

TEST(JobSpecParseTest, LoadFileErrorNamesFileAndField) {
  const std::string path = testing::TempDir() + "/job_spec_test_bad.yaml";
  {
    std::ofstream out(path);
    out << "schedule: {stagez: 4}\n";
  }
  auto spec = LoadJobSpecFile(path);
  std::remove(path.c_str());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()),
              AllOf(HasSubstr(path), HasSubstr("schedule.stagez")));
}

TEST(JobSpecParseTest, ParsesBoolsAndOptionalFields) {
  auto spec = ParseJobSpec(
      "optimizer: {lr: 0.1, momentum: 0.5, nesterov: true, weight_decay: 0.0001}\n"
      "train: {shuffle: false}\n"
      "data: {train_limit: 100, test_limit: 50}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->optimizer().nesterov());
  EXPECT_DOUBLE_EQ(spec->optimizer().weight_decay(), 0.0001);
  ASSERT_TRUE(spec->train().has_shuffle());
  EXPECT_FALSE(spec->train().shuffle());
  EXPECT_EQ(spec->data().train_limit(), 100);
  EXPECT_EQ(spec->data().test_limit(), 50);
  EXPECT_FALSE(spec->schedule().has_discrepancy_decay());
  ApplyJobSpecDefaults(*spec);
  EXPECT_FALSE(spec->train().shuffle()) << "an explicit shuffle: false must survive defaults";
}

TEST(JobSpecParseTest, NullValueLeavesFieldUnset) {
  auto spec = ParseJobSpec("name:\nschedule:\n  stages:\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name(), "");
  EXPECT_EQ(spec->schedule().stages(), 0);
}

TEST(JobSpecDefaultsTest, FillsDocumentedDefaults) {
  auto spec = ParseJobSpec(
      "name: x\nmodel: {type: mlp, layers: [784, 10]}\ndata: {type: mnist, path: d}\n"
      "optimizer: {lr: 0.1}\nschedule: {type: gpipe, stages: 1}\ntrain: {epochs: 1}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().activation(), "");
  ApplyJobSpecDefaults(*spec);
  EXPECT_EQ(spec->model().activation(), "relu");
  EXPECT_EQ(spec->optimizer().type(), "sgd");
  EXPECT_EQ(spec->schedule().microbatch_size(), 64);
  EXPECT_EQ(spec->schedule().microbatches_per_step(), 1);
  ASSERT_TRUE(spec->train().has_shuffle());
  EXPECT_TRUE(spec->train().shuffle());
  EXPECT_DOUBLE_EQ(spec->optimizer().momentum(), 0.0);
  EXPECT_EQ(spec->train().seed(), 0);
  EXPECT_FALSE(spec->schedule().has_discrepancy_decay());
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
}

TEST(JobSpecDefaultsTest, KeepsExplicitValues) {
  auto spec = ParseJobSpec(
      "model: {activation: tanh}\noptimizer: {type: sgd}\n"
      "schedule: {microbatch_size: 8, microbatches_per_step: 4}\ntrain: {shuffle: false}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ApplyJobSpecDefaults(*spec);
  EXPECT_EQ(spec->model().activation(), "tanh");
  EXPECT_EQ(spec->schedule().microbatch_size(), 8);
  EXPECT_EQ(spec->schedule().microbatches_per_step(), 4);
  EXPECT_FALSE(spec->train().shuffle());
}

TEST(JobSpecParseErrorTest, UnknownFieldNamesPathAndAllowedFields) {
  auto spec = ParseJobSpec("schedule:\n  type: pipemare\n  stagez: 4\n");
  ExpectInvalid(spec.status(), "schedule.stagez", "unknown field");
  EXPECT_THAT(std::string(spec.status().message()),
              AllOf(HasSubstr("stages"), HasSubstr("microbatch_size")));
}

TEST(JobSpecParseErrorTest, UnknownTopLevelField) {
  auto spec = ParseJobSpec("nmae: x\n");
  ExpectInvalid(spec.status(), "nmae", "unknown field");
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("schedule"));
}

TEST(JobSpecParseErrorTest, IllTypedInteger) {
  auto spec = ParseJobSpec("schedule: {stages: four}\n");
  ExpectInvalid(spec.status(), "schedule.stages", "integer");
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("four"));
}

TEST(JobSpecParseErrorTest, FractionalIntegerIsRejected) {
  ExpectInvalid(ParseJobSpec("schedule: {stages: 2.5}\n").status(), "schedule.stages", "integer");
}

TEST(JobSpecParseErrorTest, Int32OutOfRange) {
  ExpectInvalid(ParseJobSpec("schedule: {stages: 99999999999}\n").status(), "schedule.stages",
                "out of range");
}

TEST(JobSpecParseErrorTest, IllTypedNumber) {
  auto spec = ParseJobSpec("optimizer: {lr: fast}\n");
  ExpectInvalid(spec.status(), "optimizer.lr", "number");
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("fast"));
}

TEST(JobSpecParseErrorTest, IllTypedBool) {
  ExpectInvalid(ParseJobSpec("optimizer: {nesterov: maybe}\n").status(), "optimizer.nesterov",
                "true or false");
}

TEST(JobSpecParseErrorTest, ScalarWhereMappingExpected) {
  ExpectInvalid(ParseJobSpec("model: mlp\n").status(), "model", "mapping");
}

TEST(JobSpecParseErrorTest, MappingWhereScalarExpected) {
  ExpectInvalid(ParseJobSpec("name: {a: 1}\n").status(), "name", "string");
}

TEST(JobSpecParseErrorTest, LayersNotAList) {
  auto spec = ParseJobSpec("model: {type: mlp, layers: 784}\n");
  ExpectInvalid(spec.status(), "model.layers", "list");
}

TEST(JobSpecParseErrorTest, LayersElementNotAnInteger) {
  auto spec = ParseJobSpec("model: {type: mlp, layers: [784, abc, 10]}\n");
  ExpectInvalid(spec.status(), "model.layers[1]", "integer");
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("abc"));
}

TEST(JobSpecParseErrorTest, LayersElementIsAList) {
  ExpectInvalid(ParseJobSpec("model: {layers: [784, [1, 2], 10]}\n").status(), "model.layers[1]",
                "integer");
}

TEST(JobSpecParseErrorTest, MalformedYamlMentionsLine) {
  auto spec = ParseJobSpec("name: x\nmodel: {type: mlp, layers: [784, 10\n");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("line"));
}

TEST(JobSpecParseErrorTest, MalformedJsonMentionsLine) {
  auto spec = ParseJobSpec("{\"name\": \"x\",\n \"model\": {\"type\": \"mlp\"\n");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("line"));
}

TEST(JobSpecParseErrorTest, EmptyDocument) {
  for (const char* doc : {"", "\n\n", "# only a comment\n"}) {
    auto spec = ParseJobSpec(doc);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << "'" << doc << "'";
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr("empty")) << "'" << doc << "'";
  }
}

TEST(JobSpecParseErrorTest, TopLevelNotAMapping) {
  ExpectInvalid(ParseJobSpec("- a\n- b\n").status(), "spec", "mapping");
  ExpectInvalid(ParseJobSpec("just a string\n").status(), "spec", "mapping");
}

TEST(JobSpecValidateTest, ExampleIsValid) { EXPECT_TRUE(ValidateJobSpec(ValidSpec()).ok()); }

TEST(JobSpecValidateTest, GpipeWithPipeMareKnobsIsAccepted) {
  EXPECT_TRUE(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_type("gpipe"); }).ok());
}

TEST(JobSpecValidateTest, WireDtype) {
  for (const char* ok : {"", "float32", "float16", "bfloat16"}) {
    EXPECT_TRUE(
        ValidateMutated([&](v1::JobSpec& s) { s.mutable_schedule()->set_wire_dtype(ok); }).ok())
        << ok;
  }
  ExpectInvalid(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_wire_dtype("fp8"); }),
      "schedule.wire_dtype", "allowed: float32");
}

TEST(JobSpecValidateTest, Transport) {
  for (const char* ok : {"", "grpc", "gloo"}) {
    EXPECT_TRUE(
        ValidateMutated([&](v1::JobSpec& s) { s.mutable_schedule()->set_transport(ok); }).ok())
        << ok;
  }
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_transport("tcp"); }),
                "schedule.transport", "allowed: grpc (default), gloo");
}

struct MissingCase {
  const char* path;
  std::function<void(v1::JobSpec&)> clear;
};

TEST(JobSpecValidateTest, MissingRequiredFieldsAfterDefaults) {
  const MissingCase cases[] = {
      {"name", [](v1::JobSpec& s) { s.clear_name(); }},
      {"model.type", [](v1::JobSpec& s) { s.mutable_model()->clear_type(); }},
      {"data.type", [](v1::JobSpec& s) { s.mutable_data()->clear_type(); }},
      {"data.path", [](v1::JobSpec& s) { s.mutable_data()->clear_path(); }},
      {"optimizer.lr", [](v1::JobSpec& s) { s.mutable_optimizer()->clear_lr(); }},
      {"schedule.type", [](v1::JobSpec& s) { s.mutable_schedule()->clear_type(); }},
      {"schedule.stages", [](v1::JobSpec& s) { s.mutable_schedule()->clear_stages(); }},
      {"train.epochs", [](v1::JobSpec& s) { s.mutable_train()->clear_epochs(); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.path);
    v1::JobSpec spec = ValidSpec();
    c.clear(spec);
    ApplyJobSpecDefaults(spec);
    ExpectInvalid(ValidateJobSpec(spec), std::string(c.path) + ":", "required");
  }
}

TEST(JobSpecValidateTest, MissingFieldsInTextAreReportedAfterDefaults) {
  // The same through the parser: a spec lacking train.
  auto st = ParseAndValidate(
      "name: x\nmodel: {type: mlp, layers: [784, 10]}\ndata: {type: mnist, path: d}\n"
      "optimizer: {lr: 0.1}\nschedule: {type: gpipe, stages: 1}\n");
  ExpectInvalid(st, "train.epochs", "required");
}

TEST(JobSpecValidateTest, BadScheduleTypeListsAllowedValues) {
  auto st = ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_type("foo"); });
  ExpectInvalid(st, "schedule.type", "pipemare, gpipe");
  EXPECT_THAT(std::string(st.message()), HasSubstr("foo"));
}

TEST(JobSpecValidateTest, OtherBadEnumValues) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_model()->set_type("cnn"); }),
                "model.type", "mlp");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_model()->set_activation("swish"); }),
                "model.activation", "relu, tanh, gelu, sigmoid");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_data()->set_type("imagenet"); }),
                "data.type", "mnist");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_model()->set_init("xavier"); }),
                "model.init", "torch, he");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_optimizer()->set_type("rmsprop"); }),
                "optimizer.type", "sgd (default), adam, adamw");
}

TEST(JobSpecValidateTest, IdxDataTakesAPathOrAllFourFiles) {
  auto idx = [](v1::JobSpec& s) {
    s.mutable_data()->set_type("idx");
    s.mutable_model()->clear_layers();
    for (int w : {100, 64, 32, 16, 7}) s.mutable_model()->add_layers(w);  // sizes: at submit
  };
  EXPECT_TRUE(ValidateMutated(idx).ok()) << ValidateMutated(idx);
  auto files = [&](v1::JobSpec& s) {
    idx(s);
    s.mutable_data()->clear_path();
    s.mutable_data()->set_train_images("/d/a");
    s.mutable_data()->set_train_labels("/d/b");
    s.mutable_data()->set_test_images("/d/c");
    s.mutable_data()->set_test_labels("/d/d");
  };
  EXPECT_TRUE(ValidateMutated(files).ok()) << ValidateMutated(files);
  ExpectInvalid(ValidateMutated([&](v1::JobSpec& s) {
                  files(s);
                  s.mutable_data()->clear_test_labels();
                }),
                "data.test_labels", "all of data.train_images");
  ExpectInvalid(ValidateMutated([&](v1::JobSpec& s) {
                  idx(s);
                  s.mutable_data()->set_train_images("a");
                }),
                "data.train_labels", "or none");
  ExpectInvalid(ValidateMutated([&](v1::JobSpec& s) {
                  idx(s);
                  s.mutable_data()->clear_path();
                }),
                "data.path", "required");
  // mnist keeps its fixed sizes.
  ExpectInvalid(ValidateMutated([&](v1::JobSpec& s) {
                  idx(s);
                  s.mutable_data()->set_type("mnist");
                }),
                "model.layers[0]", "784");
}

TEST(JobSpecValidateTest, EveryActivationIsAccepted) {
  for (const char* act : {"relu", "tanh", "gelu", "sigmoid"}) {
    EXPECT_TRUE(
        ValidateMutated([&](v1::JobSpec& s) { s.mutable_model()->set_activation(act); }).ok())
        << act;
  }
}

TEST(JobSpecValidateTest, BadName) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.set_name("has space"); }), "name",
                "A-Z a-z 0-9");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.set_name(std::string(65, 'a')); }), "name",
                "1..64");
  EXPECT_TRUE(ValidateMutated([](v1::JobSpec& s) { s.set_name(std::string(64, 'a')); }).ok());
}

TEST(JobSpecValidateTest, StagesMoreThanUnitsMentionsUnitCount) {
  auto st = ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_stages(5); });
  ExpectInvalid(st, "schedule.stages", "4 units");
  EXPECT_THAT(std::string(st.message()), HasSubstr("at most 4"));
  EXPECT_TRUE(ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_stages(1); }).ok());
}

TEST(JobSpecValidateTest, NegativeStages) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_stages(-1); }),
                "schedule.stages", ">= 1");
}

TEST(JobSpecValidateTest, TooFewLayers) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_model()->clear_layers();
                  s.mutable_model()->add_layers(784);
                }),
                "model.layers", "at least two");
}

TEST(JobSpecValidateTest, NonPositiveLayerWidth) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_model()->set_layers(2, 0); }),
                "model.layers[2]", "1..1048576");
}

TEST(JobSpecValidateTest, MnistInputWidthMustBe784) {
  auto st = ValidateMutated([](v1::JobSpec& s) { s.mutable_model()->set_layers(0, 100); });
  ExpectInvalid(st, "model.layers[0]", "784");
  EXPECT_THAT(std::string(st.message()), HasSubstr("100"));
}

TEST(JobSpecValidateTest, MnistOutputWidthMustBe10) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_model()->set_layers(4, 7); }),
                "model.layers[4]", "10");
}

TEST(JobSpecValidateTest, MomentumOutOfRange) {
  for (double m : {1.0, 1.5, -0.1}) {
    SCOPED_TRACE(m);
    ExpectInvalid(ValidateMutated([&](v1::JobSpec& s) { s.mutable_optimizer()->set_momentum(m); }),
                  "optimizer.momentum", "[0, 1)");
  }
  EXPECT_TRUE(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_optimizer()->set_momentum(0.0); }).ok());
}

TEST(JobSpecValidateTest, NonPositiveLr) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(-0.1); }),
                "optimizer.lr", "> 0");
}

TEST(JobSpecValidateTest, NegativeWeightDecay) {
  ExpectInvalid(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_optimizer()->set_weight_decay(-1); }),
      "optimizer.weight_decay", ">= 0");
}

TEST(JobSpecValidateTest, NesterovWithoutMomentum) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_optimizer()->set_nesterov(true);
                  s.mutable_optimizer()->set_momentum(0);
                }),
                "optimizer.nesterov", "momentum > 0");
  EXPECT_TRUE(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_optimizer()->set_nesterov(true); }).ok());
}

TEST(JobSpecValidateTest, DiscrepancyDecayMustBeBelowOne) {
  for (double d : {1.0, 2.0}) {
    SCOPED_TRACE(d);
    ExpectInvalid(
        ValidateMutated([&](v1::JobSpec& s) { s.mutable_schedule()->set_discrepancy_decay(d); }),
        "schedule.discrepancy_decay", "[0, 1)");
  }
  // Negative turns T2 off and is accepted; so are 0 and values just below 1.
  for (double d : {-1.0, 0.0, 0.999}) {
    EXPECT_TRUE(ValidateMutated([&](v1::JobSpec& s) {
                  s.mutable_schedule()->set_discrepancy_decay(d);
                }).ok())
        << d;
  }
}

TEST(JobSpecValidateTest, BothAnnealStepsAndEpochs) {
  auto st =
      ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_lr_anneal_epochs(1.5); });
  ExpectInvalid(st, "schedule.lr_anneal", "not both");
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("lr_anneal_steps"), HasSubstr("lr_anneal_epochs")));
  EXPECT_TRUE(ValidateMutated([](v1::JobSpec& s) {
                s.mutable_schedule()->set_lr_anneal_steps(0);
                s.mutable_schedule()->set_lr_anneal_epochs(1.5);
              }).ok());
}

TEST(JobSpecValidateTest, NegativeAnneal) {
  ExpectInvalid(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_lr_anneal_steps(-1); }),
      "schedule.lr_anneal_steps", ">= 0");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_lr_anneal_steps(0);
                  s.mutable_schedule()->set_lr_anneal_epochs(-1);
                }),
                "schedule.lr_anneal_epochs", ">= 0");
}

TEST(JobSpecValidateTest, WarmupStepsOrEpochsNonNegativeNotBoth) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_warmup_steps(-1); }),
                "schedule.warmup_steps", ">= 0");
  ExpectInvalid(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_warmup_epochs(-0.5); }),
      "schedule.warmup_epochs", ">= 0");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_warmup_steps(10);
                  s.mutable_schedule()->set_warmup_epochs(1);
                }),
                "schedule.warmup_epochs", "not both");
  EXPECT_TRUE(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_warmup_epochs(0.5); }).ok());
}

TEST(JobSpecValidateTest, OptimizerFieldsNameTheFieldAndTheFix) {
  auto with = [](auto mutate) {
    return ValidateMutated([&](v1::JobSpec& s) { mutate(*s.mutable_optimizer()); });
  };
  ExpectInvalid(with([](v1::OptimizerSpec& o) {
                  o.set_type("adam");
                  o.set_momentum(0.9);
                }),
                "optimizer.momentum", "optimizer.beta1");
  ExpectInvalid(with([](v1::OptimizerSpec& o) {
                  o.set_type("adamw");
                  o.set_momentum(0);
                  o.set_nesterov(true);
                }),
                "optimizer.nesterov", "sgd only");
  ExpectInvalid(with([](v1::OptimizerSpec& o) { o.set_beta1(0.9); }), "optimizer.beta1",
                "adam and adamw only");
  ExpectInvalid(with([](v1::OptimizerSpec& o) {
                  o.set_type("adam");
                  o.set_momentum(0);
                  o.set_beta2(1.0);
                }),
                "optimizer.beta2", "[0, 1)");
  ExpectInvalid(with([](v1::OptimizerSpec& o) {
                  o.set_type("adam");
                  o.set_momentum(0);
                  o.set_eps(0);
                }),
                "optimizer.eps", "> 0");
  ExpectInvalid(with([](v1::OptimizerSpec& o) { o.set_grad_clip_norm(-1); }),
                "optimizer.grad_clip_norm", ">= 0");
  ExpectInvalid(with([](v1::OptimizerSpec& o) { o.set_lr_schedule("step"); }),
                "optimizer.lr_step_size", "required for lr_schedule step");
  ExpectInvalid(with([](v1::OptimizerSpec& o) {
                  o.set_lr_schedule("step");
                  o.set_lr_step_size(10);
                  o.set_lr_step_gamma(1.5);
                }),
                "optimizer.lr_step_gamma", "(0, 1]");
  ExpectInvalid(with([](v1::OptimizerSpec& o) { o.set_lr_warmup_steps(-3); }),
                "optimizer.lr_warmup_steps", ">= 0");
  EXPECT_TRUE(with([](v1::OptimizerSpec& o) {
                o.set_type("adamw");
                o.set_momentum(0);
                o.set_beta1(0.9);
                o.set_beta2(0.98);
                o.set_eps(1e-6);
                o.set_weight_decay(0.01);
                o.set_grad_clip_norm(1.0);
                o.set_lr_schedule("step");
                o.set_lr_step_size(100);
                o.set_lr_warmup_steps(50);
              }).ok());
}

TEST(JobSpecValidateTest, MicrobatchRanges) {
  ExpectInvalid(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_microbatch_size(65537); }),
      "schedule.microbatch_size", "1..65536");
  ExpectInvalid(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_microbatches_per_step(-2); }),
      "schedule.microbatches_per_step", "1..4096");
}

TEST(JobSpecValidateTest, NegativeDataLimits) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_data()->set_train_limit(-1); }),
                "data.train_limit", ">= 0");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_data()->set_test_limit(-1); }),
                "data.test_limit", ">= 0");
}

TEST(JobSpecValidateTest, EpochsRange) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_train()->set_epochs(100001); }),
                "train.epochs", "1..100000");
}

TEST(JobSpecValidateTest, WeightPredictionNeedsADirectionAndRefusesT2) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_weight_prediction(true);
                  s.mutable_optimizer()->set_type("sgd");
                  s.mutable_optimizer()->set_momentum(0);
                }),
                "schedule.weight_prediction", "momentum > 0");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_weight_prediction(true);
                  s.mutable_schedule()->set_type("pipemare");
                  s.mutable_schedule()->set_discrepancy_decay(0.1);
                  s.mutable_optimizer()->set_momentum(0.9);
                }),
                "schedule.weight_prediction", "unset discrepancy_decay");
  EXPECT_TRUE(ValidateMutated([](v1::JobSpec& s) {
                s.mutable_schedule()->set_weight_prediction(true);
                s.mutable_schedule()->set_type("async");
                s.mutable_optimizer()->set_type("adam");
                s.mutable_optimizer()->set_momentum(0);
              }).ok());
}

// The schedule each stage of a 2-stage MLP job receives, for these
// optimizer and schedule YAML maps (empty when the job does not resolve).
std::vector<v1::ScheduleSpec> ResolvedSchedules(const std::string& optimizer,
                                                const std::string& schedule) {
  auto spec = ParseJobSpec(
      "name: n\nmodel: {type: mlp, layers: [4, 3, 2]}\ndata: {type: mnist, path: d}\n"
      "optimizer: " +
      optimizer + "\nschedule: " + schedule + "\ntrain: {epochs: 1}\n");
  EXPECT_TRUE(spec.ok()) << spec.status();
  if (!spec.ok()) return {};
  auto stages = ResolveStageAssignments(*spec, "j", 4, nullptr);
  EXPECT_TRUE(stages.ok()) << stages.status();
  if (!stages.ok()) return {};
  EXPECT_EQ(stages->size(), 2u);
  std::vector<v1::ScheduleSpec> out;
  for (const auto& a : *stages) out.push_back(a.schedule());
  return out;
}

TEST(JobSpecValidateTest, SpikeCompensationNeedsPlainSgdAndReachesEveryStage) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_spike_compensation(true);
                  s.mutable_optimizer()->set_type("adam");
                  s.mutable_optimizer()->set_momentum(0);
                }),
                "schedule.spike_compensation", "'adam' has none");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_spike_compensation(true);
                  s.mutable_optimizer()->set_type("sgd");
                  s.mutable_optimizer()->set_momentum(0.9);
                  s.mutable_optimizer()->set_nesterov(true);
                }),
                "schedule.spike_compensation", "nesterov");
  for (const auto& s : ResolvedSchedules("{lr: 0.1, momentum: 0.9}",
                                         "{type: pipemare, stages: 2, spike_compensation: true}")) {
    EXPECT_TRUE(s.spike_compensation());
  }
}

TEST(JobSpecValidateTest, DelayCompensationIsALambdaAndNotWithPrediction) {
  for (double bad : {-0.5, 101.0}) {
    ExpectInvalid(ValidateMutated(
                      [bad](v1::JobSpec& s) { s.mutable_schedule()->set_delay_compensation(bad); }),
                  "schedule.delay_compensation", "[0, 100]");
  }
  ExpectInvalid(
      ValidateMutated([](v1::JobSpec& s) {
        s.mutable_schedule()->set_delay_compensation(std::numeric_limits<double>::quiet_NaN());
      }),
      "schedule.delay_compensation", "finite");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_type("async");
                  s.mutable_schedule()->set_delay_compensation(2);
                  s.mutable_schedule()->set_weight_prediction(true);
                  s.mutable_optimizer()->set_momentum(0.9);
                }),
                "schedule.delay_compensation", "weight_prediction");
  for (const auto& s : ResolvedSchedules("{type: adam, lr: 0.001}",
                                         "{type: async, stages: 2, delay_compensation: 0.5}")) {
    EXPECT_EQ(s.delay_compensation(), 0.5);
  }
}

TEST(JobSpecValidateTest, DataPlaneMinBytesIsForGlooAndNotNegative) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_data_plane_min_bytes(1 << 20);
                }),
                "schedule.data_plane_min_bytes", "set schedule.transport: gloo");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_transport("gloo");
                  s.mutable_schedule()->set_data_plane_min_bytes(-1);
                }),
                "schedule.data_plane_min_bytes", "-1 is negative");
  for (const auto& s : ResolvedSchedules(
           "{lr: 0.1}", "{type: pipemare, stages: 2, transport: gloo, data_plane_min_bytes: 0}")) {
    ASSERT_TRUE(s.has_data_plane_min_bytes()) << "0 is set, not unset";
    EXPECT_EQ(s.data_plane_min_bytes(), 0);
  }
}

TEST(JobSpecValidateTest, RecomputeIsOptionalWhereTheBackwardRunsAtTheForwardsWeights) {
  for (const char* type : {"pipemare", "async"}) {
    ExpectInvalid(ValidateMutated([&](v1::JobSpec& s) {
                    s.mutable_schedule()->set_type(type);
                    s.mutable_schedule()->set_recompute(false);
                  }),
                  "schedule.recompute", "must recompute");
  }
  // Unset: recompute only where it must; given: as given, on every stage.
  for (const char* type : {"gpipe", "1f1b", "zero_bubble", "pipedream", "pipedream_2bw"}) {
    SCOPED_TRACE(type);
    for (const auto& s :
         ResolvedSchedules("{lr: 0.1}", absl::StrCat("{type: ", type, ", stages: 2}"))) {
      EXPECT_FALSE(Recomputes(s));
    }
    for (const auto& s : ResolvedSchedules(
             "{lr: 0.1}", absl::StrCat("{type: ", type, ", stages: 2, recompute: true}"))) {
      EXPECT_TRUE(Recomputes(s));
    }
  }
  for (const auto& s : ResolvedSchedules("{lr: 0.1}", "{type: pipemare, stages: 2}")) {
    EXPECT_TRUE(Recomputes(s));
  }
}

TEST(JobSpecValidateTest, PipeDream2BWNeedsEnoughMicrobatchesAndNoOtherDelayFix) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_type("pipedream_2bw");
                  s.mutable_schedule()->set_stages(4);
                  s.mutable_schedule()->set_microbatches_per_step(2);
                }),
                "schedule.microbatches_per_step", "use at least 3");
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) {
                  s.mutable_schedule()->set_type("pipedream_2bw");
                  s.mutable_schedule()->set_stages(2);
                  s.mutable_schedule()->set_weight_prediction(true);
                }),
                "schedule.weight_prediction", "pipedream_2bw");
}

TEST(JobSpecValidateTest, OnNonFiniteIsFailOrSkipAndReachesEveryStage) {
  ExpectInvalid(
      ValidateMutated([](v1::JobSpec& s) { s.mutable_train()->set_on_nonfinite("ignore"); }),
      "train.on_nonfinite", "allowed: fail");
  auto spec = ParseJobSpec(
      "name: n\nmodel: {type: mlp, layers: [4, 3, 2]}\ndata: {type: mnist, path: d}\n"
      "optimizer: {lr: 0.1}\nschedule: {type: pipemare, stages: 2}\n"
      "train: {epochs: 1, on_nonfinite: skip}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto stages = ResolveStageAssignments(*spec, "j", 4, nullptr);
  ASSERT_TRUE(stages.ok()) << stages.status();
  for (const auto& a : *stages) EXPECT_EQ(a.on_nonfinite(), "skip");
  v1::JobSpec defaults;
  ApplyJobSpecDefaults(defaults);
  EXPECT_EQ(defaults.train().on_nonfinite(), "fail");
}

TEST(ModelUnitCountTest, MlpUnitsAreLayersMinusOne) {
  v1::ModelSpec m;
  m.set_type("mlp");
  EXPECT_EQ(ModelUnitCount(m), 0);
  m.add_layers(784);
  EXPECT_EQ(ModelUnitCount(m), 0);
  m.add_layers(10);
  EXPECT_EQ(ModelUnitCount(m), 1);
  for (int w : {512, 512, 256}) m.add_layers(w);
  EXPECT_EQ(ModelUnitCount(m), 4);
  m.set_type("cnn");
  EXPECT_EQ(ModelUnitCount(m), 0);
  m.clear_type();
  EXPECT_EQ(ModelUnitCount(m), 0);
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

TEST(JobSpecValidateTest, LearningRateSchedule) {
  v1::JobSpec spec = ValidSpec();
  EXPECT_EQ(spec.optimizer().lr_schedule(), "constant") << "the default";
  spec.mutable_optimizer()->set_lr_schedule("cosine");
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
  spec.mutable_optimizer()->set_lr_schedule("linear");
  ExpectInvalid(ValidateJobSpec(spec), "optimizer.lr_schedule", "constant (default), cosine, step");
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

// The shipped examples are valid specs (the README's main job runs one).
TEST(JobSpecExamplesTest, ShippedExamplesValidate) {
  for (const char* name : {"mnist_pipemare.yaml", "mnist_gpipe.yaml", "fashion_mnist_pipemare.yaml",
                           "mnist_fine_momentum.yaml", "resnet20_fashion_mnist.yaml",
                           "transformer_lm_fortunes.yaml"}) {
    auto spec = LoadJobSpecFile(std::string(PIPEMARE_EXAMPLES_DIR) + "/" + name);
    ASSERT_TRUE(spec.ok()) << name << ": " << spec.status();
    ApplyJobSpecDefaults(*spec);
    EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << name << ": " << ValidateJobSpec(*spec);
  }
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

// schedule.partition and schedule.split. The example model has 4 units.
TEST(JobSpecValidateTest, PartitionKinds) {
  for (const char* ok : {"", "uniform", "parameters", "profile"}) {
    EXPECT_TRUE(
        ValidateMutated([&](v1::JobSpec& s) { s.mutable_schedule()->set_partition(ok); }).ok())
        << ok;
  }
  auto st = ValidateMutated([](v1::JobSpec& s) { s.mutable_schedule()->set_partition("even"); });
  ExpectInvalid(st, "schedule.partition", "'even' is not allowed");
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("uniform (default), parameters, profile, split"));
}

TEST(JobSpecValidateTest, PartitionSplitIsValid) {
  EXPECT_TRUE(ValidateMutated([](v1::JobSpec& s) {
                auto* sc = s.mutable_schedule();
                sc->set_stages(2);
                sc->set_partition("split");
                sc->add_split(3);
              }).ok());
  EXPECT_TRUE(ValidateMutated([](v1::JobSpec& s) {
                auto* sc = s.mutable_schedule();
                sc->set_stages(3);
                sc->set_partition("split");
                sc->add_split(1);
                sc->add_split(2);
              }).ok());
  // One stage: no split points.
  EXPECT_TRUE(ValidateMutated([](v1::JobSpec& s) {
                s.mutable_schedule()->set_stages(1);
                s.mutable_schedule()->set_partition("split");
              }).ok());
  // Through the parser.
  auto spec = ParseJobSpec(
      "name: x\nmodel: {type: mlp, layers: [784, 64, 64, 10]}\ndata: {type: mnist, path: d}\n"
      "optimizer: {lr: 0.1}\nschedule: {type: gpipe, stages: 2, partition: split, split: [1]}\n"
      "train: {epochs: 1}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->schedule().partition(), "split");
  ASSERT_EQ(spec->schedule().split_size(), 1);
  EXPECT_EQ(spec->schedule().split(0), 1);
  ApplyJobSpecDefaults(*spec);
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
}

TEST(JobSpecValidateTest, SplitOnlyWithPartitionSplit) {
  for (const char* kind : {"", "uniform", "profile"}) {
    ExpectInvalid(ValidateMutated([&](v1::JobSpec& s) {
                    s.mutable_schedule()->set_partition(kind);
                    s.mutable_schedule()->set_stages(2);
                    s.mutable_schedule()->add_split(2);
                  }),
                  "schedule.split", "applies to partition split only");
  }
}

// Sets partition "split" with `stages` stages and the given points.
absl::Status ValidateSplit(int stages, std::vector<int> points) {
  return ValidateMutated([&](v1::JobSpec& s) {
    auto* sc = s.mutable_schedule();
    sc->set_stages(stages);
    sc->set_partition("split");
    for (int p : points) sc->add_split(p);
  });
}

TEST(JobSpecValidateTest, SplitErrorsNameTheIndexAndTheRange) {
  ExpectInvalid(ValidateSplit(3, {3}), "schedule.split",
                "1 points for 3 stages; give stages - 1 = 2");
  ExpectInvalid(ValidateSplit(2, {}), "schedule.split", "0 points for 2 stages");
  ExpectInvalid(ValidateSplit(3, {2, 2}), "schedule.split[1]",
                "2 is not after schedule.split[0] = 2; split points must increase");
  ExpectInvalid(ValidateSplit(3, {3, 1}), "schedule.split[1]", "1 is not after");
  ExpectInvalid(ValidateSplit(2, {0}), "schedule.split[0]",
                "0 is out of range 1..3 for a model of 4 units");
  ExpectInvalid(ValidateSplit(2, {4}), "schedule.split[0]",
                "4 is out of range 1..3 for a model of 4 units");
  ExpectInvalid(ValidateSplit(3, {1, -2}), "schedule.split[1]", "out of range");
}

TEST(JobSpecValidateTest, SplitWithUnknownUnitCountChecksWhatItCan) {
  // A TorchScript model's unit count is known only once the coordinator reads
  // the file: the count and order of split points are still checked here.
  auto torchscript = [](int stages, std::vector<int> points) {
    return ValidateMutated([&](v1::JobSpec& s) {
      s.mutable_model()->clear_layers();
      s.mutable_model()->set_type("torchscript");
      s.mutable_model()->set_path("model.pt");
      auto* sc = s.mutable_schedule();
      sc->set_stages(stages);
      sc->set_partition("split");
      for (int p : points) sc->add_split(p);
    });
  };
  EXPECT_TRUE(torchscript(3, {5, 40}).ok()) << torchscript(3, {5, 40});
  ExpectInvalid(torchscript(3, {5}), "schedule.split", "1 points for 3 stages");
  ExpectInvalid(torchscript(3, {5, 5}), "schedule.split[1]", "not after schedule.split[0] = 5");
  ExpectInvalid(torchscript(2, {0}), "schedule.split[0]", ">= 1");
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

// data.type and the fields each type takes.
v1::JobSpec WithData(const std::string& type, const std::string& path) {
  v1::JobSpec spec = ValidSpec();
  spec.mutable_data()->Clear();
  spec.mutable_data()->set_type(type);
  spec.mutable_data()->set_path(path);
  return spec;
}

TEST(JobSpecDataTest, TypesAndTheirFields) {
  EXPECT_TRUE(ValidateJobSpec(WithData("cifar", "data/cifar-10-batches-bin")).ok())
      << ValidateJobSpec(WithData("cifar", "data/cifar-10-batches-bin"));
  EXPECT_TRUE(ValidateJobSpec(WithData("text", "/usr/share/games/fortunes/cookie")).ok());
  EXPECT_TRUE(ValidateJobSpec(WithData("idx", "data/fashion")).ok());
  ExpectInvalid(ValidateJobSpec(WithData("imagenet", "x")), "data.type",
                "allowed: idx, mnist, cifar, text");

  // idx's four file fields belong to idx and mnist.
  v1::JobSpec spec = WithData("cifar", "d");
  spec.mutable_data()->set_train_images("a");
  ExpectInvalid(ValidateJobSpec(spec), "data.train_images",
                "idx and mnist only; cifar's files are data.train_files");
  spec = WithData("text", "corpus.txt");
  spec.mutable_data()->set_test_labels("a");
  ExpectInvalid(ValidateJobSpec(spec), "data.test_labels", "idx and mnist only");

  // cifar's lists belong to cifar.
  for (const char* type : {"idx", "mnist", "text"}) {
    spec = WithData(type, "d");
    spec.mutable_data()->add_train_files("a.bin");
    ExpectInvalid(ValidateJobSpec(spec), "data.train_files", "cifar only");
    spec = WithData(type, "d");
    spec.mutable_data()->add_test_files("a.bin");
    ExpectInvalid(ValidateJobSpec(spec), "data.test_files", "cifar only");
  }

  // text's fields belong to text.
  for (const char* type : {"idx", "mnist", "cifar"}) {
    spec = WithData(type, "d");
    spec.mutable_data()->set_context(32);
    ExpectInvalid(ValidateJobSpec(spec), "data.context", "text only");
    spec = WithData(type, "d");
    spec.mutable_data()->set_validation_fraction(0.2);
    ExpectInvalid(ValidateJobSpec(spec), "data.validation_fraction", "text only");
  }
}

TEST(JobSpecDataTest, CifarPathAndFiles) {
  v1::JobSpec spec = WithData("cifar", "");
  ExpectInvalid(ValidateJobSpec(spec), "data.path", "data_batch_1.bin");
  spec.mutable_data()->add_train_files("/d/data_batch_1.bin");
  ExpectInvalid(ValidateJobSpec(spec), "data.path", "both data.train_files and data.test_files");
  spec.mutable_data()->add_test_files("/d/test_batch.bin");
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_data()->add_train_files("");
  ExpectInvalid(ValidateJobSpec(spec), "data.train_files[1]", "empty");
  spec = WithData("cifar", "d");
  spec.mutable_data()->add_test_files("");
  ExpectInvalid(ValidateJobSpec(spec), "data.test_files[0]", "empty");
  // One list with data.path for the other split.
  spec = WithData("cifar", "d");
  spec.mutable_data()->add_train_files("data_batch_1.bin");
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
}

TEST(JobSpecDataTest, TextPathContextAndFraction) {
  ExpectInvalid(ValidateJobSpec(WithData("text", "")), "data.path", "corpus");
  auto with = [](auto mutate) {
    v1::JobSpec spec = WithData("text", "corpus.txt");
    mutate(*spec.mutable_data());
    return ValidateJobSpec(spec);
  };
  EXPECT_TRUE(with([](v1::DataSpec& d) {
                d.set_context(1);
                d.set_validation_fraction(0.5);
              }).ok());
  EXPECT_TRUE(with([](v1::DataSpec& d) { d.set_context(65536); }).ok());
  ExpectInvalid(with([](v1::DataSpec& d) { d.set_context(65537); }), "data.context", "1..65536");
  ExpectInvalid(with([](v1::DataSpec& d) { d.set_context(-4); }), "data.context", "1..65536");
  ExpectInvalid(with([](v1::DataSpec& d) { d.set_validation_fraction(1); }),
                "data.validation_fraction", "(0, 1)");
  ExpectInvalid(with([](v1::DataSpec& d) { d.set_validation_fraction(-0.5); }),
                "data.validation_fraction", "(0, 1)");
  ExpectInvalid(with([](v1::DataSpec& d) { d.set_train_limit(-1); }), "data.train_limit", ">= 0");
}

TEST(JobSpecDataTest, NormalizeIsForImages) {
  v1::JobSpec spec = WithData("text", "corpus.txt");
  spec.mutable_data()->set_normalize(true);
  ExpectInvalid(ValidateJobSpec(spec), "data.normalize", "images only");
  spec = WithData("mnist", "data/mnist");
  spec.mutable_data()->set_normalize(false);
  ExpectInvalid(ValidateJobSpec(spec), "data.normalize", "data.type idx");
  spec.mutable_data()->set_normalize(true);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  for (const char* type : {"idx", "cifar"}) {
    spec = WithData(type, "d");
    spec.mutable_data()->set_normalize(false);
    EXPECT_TRUE(ValidateJobSpec(spec).ok()) << type << ": " << ValidateJobSpec(spec);
  }
}

// MNIST's widths are an MLP's business: other model types are checked against
// the data when it is read.
TEST(JobSpecDataTest, MnistWidthsOnlyConstrainAnMlp) {
  ExpectInvalid(ValidateMutated([](v1::JobSpec& s) { s.mutable_model()->set_layers(0, 100); }),
                "model.layers[0]", "MNIST images have 784 pixels");
  // The same widths are fine on idx data (checked against the files at submit).
  EXPECT_TRUE(ValidateMutated([](v1::JobSpec& s) {
                s.mutable_model()->set_layers(0, 100);
                s.mutable_data()->set_type("idx");
              }).ok());
  const absl::Status st = ValidateMutated([](v1::JobSpec& s) {
    s.mutable_model()->clear_layers();
    s.mutable_model()->set_type("resnet");
  });
  EXPECT_THAT(std::string(st.message()), ::testing::Not(HasSubstr("MNIST"))) << st;
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

namespace pb = google::protobuf;
using FD = pb::FieldDescriptor;

// Every chain of fields from a JobSpec down to a float or double field
// (through nested and repeated messages; each message type once per chain).
void FloatFields(const pb::Descriptor* d, std::vector<const FD*>* chain,
                 std::vector<const pb::Descriptor*>* seen,
                 std::vector<std::vector<const FD*>>* out) {
  for (int i = 0; i < d->field_count(); ++i) {
    const FD* f = d->field(i);
    chain->push_back(f);
    if (f->cpp_type() == FD::CPPTYPE_DOUBLE || f->cpp_type() == FD::CPPTYPE_FLOAT) {
      out->push_back(*chain);
    } else if (f->cpp_type() == FD::CPPTYPE_MESSAGE && !f->is_map() &&
               std::find(seen->begin(), seen->end(), f->message_type()) == seen->end()) {
      seen->push_back(f->message_type());
      FloatFields(f->message_type(), chain, seen, out);
      seen->pop_back();
    }
    chain->pop_back();
  }
}

TEST(JobSpecValidateTest, EveryFloatingPointFieldRefusesNaNAndInfinityNamingItsPath) {
  std::vector<std::vector<const FD*>> chains;
  std::vector<const FD*> chain;
  std::vector<const pb::Descriptor*> seen = {v1::JobSpec::descriptor()};
  FloatFields(v1::JobSpec::descriptor(), &chain, &seen, &chains);
  ASSERT_GE(chains.size(), 10u) << "the spec's learning rates, momentum, T1/T2 knobs, ...";
  for (const double bad : {std::nan(""), std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()}) {
    for (const auto& c : chains) {
      v1::JobSpec spec = ValidSpec();
      pb::Message* msg = &spec;
      std::string path;
      for (size_t i = 0; i < c.size(); ++i) {
        const FD* f = c[i];
        const pb::Reflection* r = msg->GetReflection();
        absl::StrAppend(&path, path.empty() ? "" : ".", f->name());
        if (f->is_repeated()) absl::StrAppend(&path, "[", r->FieldSize(*msg, f), "]");
        if (i + 1 < c.size()) {
          msg = f->is_repeated() ? r->AddMessage(msg, f) : r->MutableMessage(msg, f);
        } else if (f->cpp_type() == FD::CPPTYPE_DOUBLE) {
          f->is_repeated() ? r->AddDouble(msg, f, bad) : r->SetDouble(msg, f, bad);
        } else {
          const float v = static_cast<float>(bad);
          f->is_repeated() ? r->AddFloat(msg, f, v) : r->SetFloat(msg, f, v);
        }
      }
      const absl::Status st = ValidateJobSpec(spec);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << path << " = " << bad;
      EXPECT_THAT(std::string(st.message()), HasSubstr(path + ": ")) << st;
      EXPECT_THAT(std::string(st.message()), HasSubstr("give a finite value")) << st;
    }
  }
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

// A mistake in a spec is refused where it is made, not turned into a
// default or silently ignored (a user's first day).
absl::Status ParsedAndChecked(const std::string& yaml) {
  auto spec = ParseJobSpec(yaml);
  if (!spec.ok()) return spec.status();
  ApplyJobSpecDefaults(*spec);
  return ValidateJobSpec(*spec);
}

TEST(FirstDaySpec, AnExplicitZeroIsRefusedWhereItWouldHaveBecomeTheDefault) {
  for (const auto& [field, yaml, fix] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"schedule.microbatch_size", "  microbatch_size: 0\n", "1..65536"},
           {"schedule.microbatches_per_step", "  microbatches_per_step: 0\n", "1..4096"}}) {
    std::string spec = kYamlSpec;
    const std::string line = field == "schedule.microbatch_size" ? "  microbatch_size: 64\n"
                                                                 : "  microbatches_per_step: 1\n";
    spec.replace(spec.find(line), line.size(), yaml);
    const absl::Status st = ParsedAndChecked(spec);
    EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr(field), HasSubstr(fix))) << st;
  }
  const absl::Status keep = ParsedAndChecked(std::string(kYamlSpec) + "checkpoint:\n  keep: 0\n");
  EXPECT_THAT(std::string(keep.message()),
              AllOf(HasSubstr("checkpoint.keep"), HasSubstr("default 3")))
      << keep;
  EXPECT_TRUE(ParsedAndChecked(std::string(kYamlSpec) + "checkpoint:\n  keep: 1\n").ok());
}

TEST(FirstDaySpec, AKeyGivenTwiceIsRefusedNamingIt) {
  const absl::Status st =
      ParsedAndChecked(std::string(kYamlSpec) + "optimizer:\n  type: adam\n  lr: 0.001\n");
  EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr("optimizer"), HasSubstr("twice"))) << st;
  std::string inner = kYamlSpec;
  inner.replace(inner.find("  lr: 0.05\n"), 11, "  lr: 0.05\n  lr: 0.1\n");
  const absl::Status st2 = ParsedAndChecked(inner);
  EXPECT_THAT(std::string(st2.message()), AllOf(HasSubstr("optimizer.lr"), HasSubstr("twice")))
      << st2;
}

TEST(FirstDaySpec, AFieldOfAnotherModelFamilyIsRefused) {
  std::string spec = kYamlSpec;
  spec.replace(spec.find("  activation: relu\n"), 18, "  activation: relu\n  depth: 20\n");
  const absl::Status st = ParsedAndChecked(spec);
  EXPECT_THAT(
      std::string(st.message()),
      AllOf(HasSubstr("model.depth"), HasSubstr("resnet and transformer_lm"), HasSubstr("not mlp")))
      << st;
}

TEST(FirstDaySpec, AModelOfTooManyUnitsIsRefusedBeforeAnyShapePass) {
  std::string layers = "[784";
  for (int i = 0; i < 100000; ++i) absl::StrAppend(&layers, ", 16");
  layers += ", 10]";
  std::string spec = kYamlSpec;
  spec.replace(spec.find("[784, 512, 512, 256, 10]"), 24, layers);
  const absl::Status st = ParsedAndChecked(spec);
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("model.layers"), HasSubstr("100001 pipeline units"),
                    HasSubstr(absl::StrCat(kMaxModelUnits))))
      << st.message().substr(0, 300);
}

TEST(FirstDaySpec, ADirectoryIsNotASpecFile) {
  const std::string dir = ::testing::TempDir();
  auto spec = LoadJobSpecFile(dir);
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()),
              AllOf(HasSubstr("is a directory"), HasSubstr("spec file")));
}

// Each enumerated setting's allowed set is written once (pipeline/core/settings.h,
// ScheduleKind): names round-trip, an empty field is its default, and a bad
// one names the field and every allowed value.
TEST(SettingsTest, EachAllowedSetRoundTripsDefaultsWhenEmptyAndNamesTheFieldWhenBad) {
  for (PartitionKind k : {PartitionKind::kUniform, PartitionKind::kParameters,
                          PartitionKind::kProfile, PartitionKind::kSplit}) {
    EXPECT_EQ(*ParsePartition(PartitionName(k)), k);
  }
  for (Transport t : {Transport::kGrpc, Transport::kGloo}) {
    EXPECT_EQ(*ParseTransport(TransportName(t)), t);
  }
  for (OnNonFinite p : {OnNonFinite::kFail, OnNonFinite::kSkip}) {
    EXPECT_EQ(*ParseOnNonFinite(OnNonFiniteName(p)), p);
  }
  for (WireDtype d : {WireDtype::kFloat32, WireDtype::kFloat16, WireDtype::kBFloat16}) {
    EXPECT_EQ(*ParseWireDtype(WireDtypeName(d)), d);
  }
  EXPECT_EQ(*ParseWireDtype(""), WireDtype::kFloat32);
  for (ScheduleKind k : {ScheduleKind::kGPipe, ScheduleKind::kPipeDream, ScheduleKind::kAsync,
                         ScheduleKind::kPipeMare}) {
    EXPECT_EQ(*ParseScheduleKind(ScheduleName(k)), k);
  }
  EXPECT_EQ(*ParsePartition(""), PartitionKind::kUniform);
  EXPECT_EQ(*ParseTransport(""), Transport::kGrpc);
  EXPECT_EQ(*ParseOnNonFinite(""), OnNonFinite::kFail);
  EXPECT_THAT(std::string(ParsePartition("even").status().message()),
              AllOf(HasSubstr("schedule.partition: 'even'"),
                    HasSubstr("uniform (default), parameters, profile, split")));
  EXPECT_THAT(std::string(ParseOnNonFinite("ignore").status().message()),
              AllOf(HasSubstr("train.on_nonfinite"), HasSubstr("skip (drop the microbatch)")));
  EXPECT_THAT(std::string(ParseScheduleKind("1F1B").status().message()),
              HasSubstr("allowed: pipemare, gpipe, 1f1b, zero_bubble, pipedream, pipedream_2bw, "
                        "async"));
  for (const char* name :
       {"gpipe", "1f1b", "zero_bubble", "pipedream", "pipedream_2bw", "async", "pipemare"}) {
    EXPECT_STREQ(ScheduleName(*ParseScheduleKind(name)), name);
  }
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

TEST(JobSpecValidateTest, ReplicasAreOneToSixtyFourAndShareEachEpoch) {
  for (int bad : {0, -1, kMaxReplicas + 1}) {
    ExpectInvalid(ValidateMutated([&](v1::JobSpec& s) { s.mutable_schedule()->set_replicas(bad); }),
                  "schedule.replicas", "must be in 1..64");
  }
  v1::JobSpec spec = ValidSpec();
  spec.mutable_schedule()->set_replicas(4);
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
  // An epoch of 6400 examples in microbatches of 32, 2 per step: 100 steps
  // on one pipeline, 25 when 4 replicas each take 2 microbatches a step.
  v1::ScheduleSpec s;
  s.set_microbatch_size(32);
  s.set_microbatches_per_step(2);
  EXPECT_EQ(StepsPerEpoch(6400, s), 100);
  s.set_replicas(4);
  EXPECT_EQ(StepsPerEpoch(6400, s), 25);
  EXPECT_EQ(Replicas(s), 4);
  EXPECT_EQ(Replicas(v1::ScheduleSpec()), 1);
}

}  // namespace
}  // namespace pipemare
