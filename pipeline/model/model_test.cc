// Models as units: the zoo, layer lists, TorchScript import, the shape pass
// and unit profiling.
#include "pipeline/model/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "pipeline/core/job_spec.h"

namespace pipemare {
namespace {

using ::testing::HasSubstr;

v1::ModelSpec Mlp(const std::vector<int64_t>& layers, const std::string& activation = "relu") {
  v1::ModelSpec m;
  m.set_type("mlp");
  for (int64_t w : layers) m.add_layers(w);
  m.set_activation(activation);
  return m;
}

torch::nn::Sequential MustBuild(const v1::ModelSpec& m, int first, int units, int64_t seed = 11,
                                TensorType in = {}) {
  if (in.shape.empty()) in.shape = {m.layers(first)};
  auto s = BuildUnits(m, first, units, seed, in);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? s->module : torch::nn::Sequential();
}

v1::ModelSpec FromYaml(const std::string& yaml) {
  auto spec = ParseJobSpec(absl::StrCat("name: t\nmodel: ", yaml));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? spec->model() : v1::ModelSpec();
}

const TensorType kImage{{1, 28, 28}, false};

// ---------------------------------------------------------------------------
// mlp

TEST(BuildUnitsTest, WeightsDoNotDependOnThePartition) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 2});
  torch::nn::Sequential whole = MustBuild(model, 0, 3);
  EXPECT_EQ(whole->size(), 3u) << "one child per unit";
  std::vector<torch::Tensor> split;
  std::vector<torch::nn::Sequential> parts;
  for (int u = 0; u < 3; ++u) {
    parts.push_back(MustBuild(model, u, 1));
    for (const auto& p : parts.back()->parameters()) split.push_back(p);
  }
  const auto joined = whole->parameters();
  ASSERT_EQ(joined.size(), split.size());
  for (size_t i = 0; i < joined.size(); ++i) {
    EXPECT_TRUE(torch::equal(joined[i], split[i])) << "parameter " << i;
  }
  torch::NoGradGuard no_grad;
  torch::manual_seed(1);
  torch::Tensor x = torch::randn({5, 4});
  torch::Tensor chained = parts[2]->forward(parts[1]->forward(parts[0]->forward(x)));
  EXPECT_TRUE(torch::allclose(whole->forward(x), chained, 1e-6, 1e-7));
}

TEST(BuildUnitsTest, MlpUnitIsLinearThenActivationAndFlattensImages) {
  for (const char* act : {"relu", "tanh", "gelu", "sigmoid"}) {
    auto s = MustBuild(Mlp({4, 3, 2}, act), 0, 2);
    auto p = s->parameters();  // w0 b0 w1 b1
    torch::NoGradGuard no_grad;
    torch::manual_seed(2);
    torch::Tensor x = torch::randn({5, 4});
    torch::Tensor h = torch::nn::functional::linear(x, p[0], p[1]);
    h = std::string(act) == "relu"   ? torch::relu(h)
        : std::string(act) == "tanh" ? torch::tanh(h)
        : std::string(act) == "gelu" ? torch::gelu(h)
                                     : torch::sigmoid(h);
    torch::Tensor expected = torch::nn::functional::linear(h, p[2], p[3]);  // no activation last
    EXPECT_TRUE(torch::allclose(s->forward(x), expected, 1e-5, 1e-6)) << act;
  }
  // MNIST's images arrive as [B, 1, 28, 28]; the first unit flattens them.
  auto built = BuildUnits(Mlp({784, 10}), 0, 1, 0, kImage);
  ASSERT_TRUE(built.ok()) << built.status();
  EXPECT_EQ(built->units[0].out.shape, std::vector<int64_t>{10});
  EXPECT_EQ(built->units[0].name, "linear");
}

TEST(BuildUnitsTest, HeInitKeepsTheSignalOfADeepReluMlp) {
  v1::ModelSpec model = Mlp({784, 512, 512, 10});
  model.set_init("he");
  auto params = MustBuild(model, 0, 3)->parameters();
  EXPECT_NEAR(params[0].std().item<double>(), std::sqrt(2.0 / 784), 0.02 * std::sqrt(2.0 / 784));
  EXPECT_EQ(params[1].abs().max().item<double>(), 0) << "zero biases";
}

TEST(BuildUnitsTest, SeedChangesWeights) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 2});
  auto a = MustBuild(model, 0, 3, 1)->parameters();
  auto b = MustBuild(model, 0, 3, 2)->parameters();
  auto a2 = MustBuild(model, 0, 3, 1)->parameters();
  EXPECT_FALSE(torch::equal(a[0], b[0]));
  EXPECT_TRUE(torch::equal(a[0], a2[0]));
}

TEST(BuildUnitsTest, Errors) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 2});
  const TensorType in{{4}, false};
  EXPECT_EQ(BuildUnits(model, 2, 2, 0, in).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildUnits(model, 3, 1, 0, in).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildUnits(model, -1, 1, 0, in).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildUnits(model, 0, 0, 0, in).status().code(), absl::StatusCode::kInvalidArgument);
  v1::ModelSpec cnn = model;
  cnn.set_type("cnn");
  EXPECT_THAT(BuildUnits(cnn, 0, 1, 0, in).status().message(), HasSubstr("model.type"));
  // The first width must be the input's features.
  EXPECT_THAT(BuildUnits(Mlp({100, 10}), 0, 1, 0, kImage).status().message(),
              HasSubstr("model.layers[0]: is 100 but the input [B, 1, 28, 28] has 784 features"));
}

// ---------------------------------------------------------------------------
// The zoo

TEST(ZooTest, ResNet20IsAStemNineBlocksAndAHead) {
  v1::ModelSpec m;
  m.set_type("resnet");
  ASSERT_TRUE(ResolveModel(m, 10, 0).ok());
  EXPECT_EQ(m.depth(), 20);
  EXPECT_EQ(ModelUnitCount(m), 11);
  auto units = ShapePass(m, kImage);
  ASSERT_TRUE(units.ok()) << units.status();
  ASSERT_EQ(units->size(), 11u);
  EXPECT_EQ((*units)[0].out.shape, (std::vector<int64_t>{16, 28, 28}));
  EXPECT_EQ((*units)[3].out.shape, (std::vector<int64_t>{16, 28, 28}));
  EXPECT_EQ((*units)[4].out.shape, (std::vector<int64_t>{32, 14, 14})) << "stride 2 at group 2";
  EXPECT_EQ((*units)[7].out.shape, (std::vector<int64_t>{64, 7, 7}));
  EXPECT_EQ((*units)[10].out.shape, std::vector<int64_t>{10});
  int64_t params = 0;
  for (const auto& u : *units) params += u.parameters;
  // ResNet-20 on 3-channel images has 0.27M parameters; with 1 channel the
  // stem has 2 x 9 x 16 fewer.
  EXPECT_EQ(params, 272474 - 2 * 9 * 16);
  // ResNet-32: 5 blocks per group.
  m.set_depth(32);
  EXPECT_EQ(ModelUnitCount(m), 17);
}

TEST(ZooTest, ResNetTrainsItsBatchNormAndEvaluatesWithRunningStats) {
  v1::ModelSpec m;
  m.set_type("resnet");
  m.set_width(4);
  ASSERT_TRUE(ResolveModel(m, 3, 0).ok());
  auto built = BuildUnits(m, 0, ModelUnitCount(m), 1, TensorType{{3, 8, 8}, false});
  ASSERT_TRUE(built.ok()) << built.status();
  torch::nn::Sequential net = built->module;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::manual_seed(3);
  torch::Tensor x = torch::randn({16, 3, 8, 8});
  torch::Tensor y = torch::randint(0, 3, {16}, torch::kLong);
  double first = 0, last = 0;
  for (int i = 0; i < 30; ++i) {
    sgd.zero_grad();
    torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    sgd.step();
    (i == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first * 0.5) << "a ResNet memorises 16 examples";
  net->eval();
  torch::NoGradGuard no_grad;
  EXPECT_EQ(net->forward(x.slice(0, 0, 1)).sizes(), (std::vector<int64_t>{1, 3}));
}

TEST(ZooTest, TransformerLmIsCausal) {
  v1::ModelSpec m;
  m.set_type("transformer_lm");
  m.set_width(32);
  m.set_depth(2);
  ASSERT_TRUE(ResolveModel(m, 256, 16).ok());
  EXPECT_EQ(m.context(), 16);
  EXPECT_EQ(ModelUnitCount(m), 4);
  const TensorType tokens{{16}, true};
  auto built = BuildUnits(m, 0, 4, 1, tokens);
  ASSERT_TRUE(built.ok()) << built.status();
  EXPECT_EQ(built->units[0].out.shape, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(built->units[3].out.shape, (std::vector<int64_t>{16, 256}));
  torch::nn::Sequential net = built->module;
  net->eval();
  torch::NoGradGuard no_grad;
  torch::Tensor a = torch::randint(0, 256, {2, 16}, torch::kLong);
  torch::Tensor b = a.clone();
  b.index_put_({torch::indexing::Slice(), 10}, (a.select(1, 10) + 1) % 256);
  torch::Tensor ya = net->forward(a), yb = net->forward(b);
  // Changing token 10 changes nothing before position 10 and something from it on.
  EXPECT_TRUE(torch::allclose(ya.slice(1, 0, 10), yb.slice(1, 0, 10), 1e-5, 1e-6));
  EXPECT_FALSE(torch::allclose(ya.slice(1, 10), yb.slice(1, 10), 1e-5, 1e-6));
  // A float input is refused naming the unit.
  EXPECT_THAT(BuildUnits(m, 0, 1, 1, TensorType{{16}, false}).status().message(),
              HasSubstr("unit 0 (transformer_lm embedding): expects token ids"));
}

TEST(ZooTest, ResolveModelChecksTheZooOptions) {
  v1::ModelSpec m;
  m.set_type("resnet");
  m.set_depth(21);
  EXPECT_THAT(ResolveModel(m, 10, 0).message(), HasSubstr("model.depth: 21 is not 6n + 2"));
  m.set_type("transformer_lm");
  m.set_depth(2);
  m.set_width(30);
  m.set_heads(4);
  EXPECT_THAT(ResolveModel(m, 256, 8).message(), HasSubstr("model.heads: 4 heads do not divide"));
  m.set_width(32);
  m.set_context(4);
  EXPECT_THAT(ResolveModel(m, 256, 8).message(),
              HasSubstr("model.context: 4 positions but data.context is 8"));
  m.set_context(0);
  m.set_classes(10);
  EXPECT_THAT(ResolveModel(m, 256, 8).message(), HasSubstr("model.classes"));
}

// ---------------------------------------------------------------------------
// Layer lists

TEST(SequentialTest, AConvNetFromAList) {
  const v1::ModelSpec m = FromYaml(R"({type: sequential, units: [
      {type: conv2d, out: 8, kernel: 3, padding: 1}, {type: batchnorm2d}, {type: relu},
      {type: maxpool2d},
      {type: residual, body: [{type: conv2d, out: 16, stride: 2, padding: 1}, {type: relu}]},
      {type: adaptive_avgpool2d}, {type: flatten}, {type: dropout, p: 0.1},
      {type: linear, in: 16, out: 10}]})");
  ASSERT_EQ(m.units_size(), 9);
  auto units = ShapePass(m, kImage);
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_EQ((*units)[3].out.shape, (std::vector<int64_t>{8, 14, 14}));
  EXPECT_EQ((*units)[4].out.shape, (std::vector<int64_t>{16, 7, 7})) << "projection shortcut";
  EXPECT_EQ((*units)[8].out.shape, std::vector<int64_t>{10});
  EXPECT_EQ((*units)[8].parameters, 16 * 10 + 10);
}

TEST(SequentialTest, ATransformerFromAList) {
  const v1::ModelSpec m = FromYaml(R"({type: sequential, units: [
      {type: embedding, vocab: 50, dim: 16, context: 8},
      {type: transformer_block, heads: 2}, {type: layernorm}, {type: linear, out: 50}]})");
  auto units = ShapePass(m, TensorType{{8}, true});
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_EQ((*units)[3].out.shape, (std::vector<int64_t>{8, 50}));
}

TEST(SequentialTest, TheShapePassNamesTheUnitAndBothShapes) {
  auto error = [](const std::string& yaml, const TensorType& in) {
    return std::string(ShapePass(FromYaml(yaml), in).status().message());
  };
  EXPECT_THAT(
      error("{type: sequential, units: [{type: flatten}, {type: linear, in: 100, out: 10}]}",
            kImage),
      HasSubstr("model.units[1] (linear): declares in: 100 features but its input "
                "[B, 784] has 784"));
  EXPECT_THAT(error("{type: sequential, units: [{type: flatten}, {type: conv2d, out: 4}]}", kImage),
              HasSubstr("model.units[1] (conv2d): expects [B, C, H, W] but its input is [B, 784]"));
  EXPECT_THAT(error("{type: sequential, units: [{type: conv2d, out: 4, kernel: 40}]}", kImage),
              HasSubstr("model.units[0] (conv2d): does not fit its input [B, 1, 28, 28]"));
  EXPECT_THAT(error("{type: sequential, units: [{type: linear, out: 4}]}", TensorType{{8}, true}),
              HasSubstr("token ids need an embedding first"));
  EXPECT_THAT(error("{type: sequential, units: [{type: conv2d, out: 4}, {type: residual, body: "
                    "[{type: flatten}]}]}",
                    kImage),
              HasSubstr("model.units[1] (residual): its body turns [B, 4, 26, 26] into "
                        "[B, 2704]"));
  EXPECT_THAT(error("{type: sequential, units: [{type: attention}]}", kImage),
              HasSubstr("model.units[0].type: 'attention' is not a layer type; allowed: linear"));
  EXPECT_THAT(error("{type: sequential, units: [{type: flatten}, {type: linear}]}", kImage),
              HasSubstr("model.units[1].out: required for linear"));
}

// ---------------------------------------------------------------------------
// TorchScript

// A scripted module whose forward is `body` over parameter `w` (and `b`).
torch::jit::Module ScriptLinear(const std::string& name, int64_t in, int64_t out) {
  torch::jit::Module m(name);
  torch::manual_seed(in * 100 + out);
  m.register_parameter("weight", torch::randn({out, in}) * 0.1, false);
  m.register_parameter("bias", torch::zeros({out}), false);
  m.define(R"(
def forward(self, x):
    return torch.matmul(x, self.weight.t()) + self.bias
)");
  return m;
}

std::string Save(const torch::jit::Module& m) {
  std::ostringstream out;
  m.save(out);
  return out.str();
}

torch::jit::Module ScriptSequential(const std::string& class_name) {
  torch::jit::Module seq(class_name);
  seq.register_module("0", ScriptLinear("Linear", 6, 5));
  torch::jit::Module relu("ReLU");
  relu.define("def forward(self, x):\n    return torch.relu(x)\n");
  seq.register_module("1", relu);
  seq.register_module("2", ScriptLinear("Linear", 5, 3));
  return seq;
}

TEST(TorchScriptTest, EachTopLevelChildIsAUnitAndTrains) {
  const std::string bytes =
      Save(ScriptSequential("__torch__.torch.nn.modules.container.Sequential"));
  v1::ModelSpec m;
  m.set_type("torchscript");
  ASSERT_EQ(CountUnits(m, bytes).value_or(-1), 3);
  auto units = ShapePass(m, TensorType{{6}, false}, bytes);
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_EQ((*units)[0].name, "Linear");
  EXPECT_EQ((*units)[2].out.shape, std::vector<int64_t>{3});
  EXPECT_EQ((*units)[0].parameters, 6 * 5 + 5);
  // Stage [1, 3): the optimizer's steps reach the scripted weights.
  auto stage = BuildUnits(m, 1, 2, 0, TensorType{{5}, false}, bytes);
  ASSERT_TRUE(stage.ok()) << stage.status();
  torch::nn::Sequential net = stage->module;
  ASSERT_EQ(net->parameters().size(), 2u);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.5));
  torch::manual_seed(4);
  torch::Tensor x = torch::randn({8, 5});
  torch::Tensor y = torch::randint(0, 3, {8}, torch::kLong);
  double first = 0, last = 0;
  for (int i = 0; i < 20; ++i) {
    sgd.zero_grad();
    torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    sgd.step();
    (i == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
  // A shape that does not fit a scripted unit is named.
  EXPECT_THAT(ShapePass(m, TensorType{{7}, false}, bytes).status().message(),
              HasSubstr("unit 0 (Linear): does not fit its input [B, 7]"));
}

TEST(TorchScriptTest, RefusesWhatIsNotASequential) {
  v1::ModelSpec m;
  m.set_type("torchscript");
  EXPECT_THAT(CountUnits(m, Save(ScriptLinear("MyNet", 2, 2))).status().message(),
              HasSubstr("model.path: holds a TorchScript 'MyNet', not an nn.Sequential"));
  EXPECT_THAT(CountUnits(m, "not a zip file").status().message(),
              HasSubstr("model.path: is not a TorchScript file"));
  EXPECT_THAT(ReadTorchScript("/nonexistent/model.pt").status().message(),
              HasSubstr("model.path: cannot open '/nonexistent/model.pt'"));
}

// ---------------------------------------------------------------------------
// Profiling

TEST(ProfileUnitsTest, TimesEveryUnitForwardAndBackward) {
  const v1::ModelSpec m = FromYaml(R"({type: sequential, units: [
      {type: linear, out: 16}, {type: linear, out: 512}, {type: linear, out: 512},
      {type: relu}, {type: linear, out: 4}]})");
  auto costs = ProfileUnits(m, "", TensorType{{16}, false}, 0, 64, 3, 1);
  ASSERT_TRUE(costs.ok()) << costs.status();
  ASSERT_EQ(costs->forward_seconds.size(), 5u);
  for (size_t u = 0; u < 5; ++u) {
    EXPECT_GT(costs->forward_seconds[u], 0);
    EXPECT_GT(costs->backward_seconds[u], 0);
  }
  EXPECT_EQ(costs->parameters[2], 512 * 512 + 512);
  // That the costs rank units by their work is a timing claim, measured by
  // bench/partition.sh, not asserted here.
}

// ---------------------------------------------------------------------------
// PlanModel: the model against its data

v1::JobSpec Job(const std::string& model_yaml, int stages) {
  auto spec = ParseJobSpec(absl::StrCat("name: t\nmodel: ", model_yaml,
                                        "\nschedule: {type: pipemare, stages: ", stages, "}"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : v1::JobSpec();
}

DataInfo Images(int64_t classes) {
  DataInfo d;
  d.input_shape = {1, 28, 28};
  d.classes = classes;
  return d;
}

DataInfo Text(int64_t context) {
  DataInfo d;
  d.task = Task::kLanguageModel;
  d.input_shape = {context};
  d.classes = 256;
  return d;
}

TEST(PlanModelTest, ResolvesTheZooFromTheData) {
  auto plan = PlanModel(Job("{type: resnet}", 4), Images(10));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->model.classes(), 10);
  EXPECT_EQ(plan->units.size(), 11u);
  EXPECT_EQ(plan->units.back().out.shape, std::vector<int64_t>{10});
  auto lm = PlanModel(Job("{type: transformer_lm, width: 32}", 4), Text(16));
  ASSERT_TRUE(lm.ok()) << lm.status();
  EXPECT_EQ(lm->model.context(), 16);
  EXPECT_TRUE(lm->input.tokens);
  EXPECT_EQ(lm->units.back().out.shape, (std::vector<int64_t>{16, 256}));
}

TEST(PlanModelTest, RefusesAModelThatDoesNotEndInTheTasksLogits) {
  EXPECT_THAT(
      PlanModel(Job("{type: sequential, units: [{type: flatten}, {type: linear, out: 5}]}", 1),
                Images(10))
          .status()
          .message(),
      HasSubstr("model.units[1]: gives [B, 5] but the data has 10 classes"));
  EXPECT_THAT(PlanModel(Job("{type: sequential, units: [{type: embedding, vocab: 256, dim: 8}, "
                            "{type: flatten}, {type: linear, out: 256}]}",
                            1),
                        Text(16))
                  .status()
                  .message(),
              HasSubstr("a language model on this data must give logits [B, 16, 256]"));
  EXPECT_THAT(PlanModel(Job("{type: resnet}", 12), Images(10)).status().message(),
              HasSubstr("schedule.stages: 12 stages but the model has only 11 units"));
  v1::JobSpec split = Job("{type: resnet}", 3);
  split.mutable_schedule()->set_partition("split");
  split.mutable_schedule()->add_split(4);
  split.mutable_schedule()->add_split(11);
  EXPECT_THAT(PlanModel(split, Images(10)).status().message(), HasSubstr("schedule.split[1]"));
}

TEST(SequentialTest, AUnitTooLargeToAllocateIsRefusedBeforeItIsBuilt) {
  // 784 x 16M: building it would take 50 GB.
  EXPECT_THAT(
      ShapePass(
          FromYaml("{type: sequential, units: [{type: flatten}, {type: linear, out: 16000000}, "
                   "{type: relu}]}"),
          kImage)
          .status()
          .message(),
      HasSubstr("model.units[1] (linear): would hold 12560000000 parameters; a unit may hold "
                "at most 1073741824"));
  v1::ModelSpec wide;
  wide.set_type("transformer_lm");
  wide.set_width(65536);
  wide.set_heads(4);
  ASSERT_TRUE(ResolveModel(wide, 256, 8).ok());
  EXPECT_THAT(ShapePass(wide, TensorType{{8}, true}).status().message(),
              HasSubstr("unit 1 (transformer_lm block): would hold"));
}

TEST(SequentialTest, TheModelBudgetCountsEveryUnitAndEveryLayerOfAResidual) {
  // 784 -> 100 (78500 parameters), then 100 -> 100 inside a residual
  // (2 x 10100): 98700 in all, 394800 bytes.
  const v1::ModelSpec m = FromYaml(
      "{type: sequential, units: [{type: flatten}, {type: linear, out: 100}, "
      "{type: residual, body: [{type: linear, out: 100}, {type: linear, out: 100}]}]}");
  EXPECT_TRUE(ShapePass(m, kImage, "", 394800).ok());
  EXPECT_THAT(ShapePass(m, kImage, "", 394800 - 4).status().message(),
              HasSubstr("model.units[2].body[1] (linear): would hold 10100 parameters (40400 "
                        "bytes of float32), more than the 10099 the model may still hold under "
                        "the coordinator's --max-model-bytes 394796"));
  EXPECT_THAT(ShapePass(m, kImage, "", 350000).status().message(),
              HasSubstr("model.units[2].body[0] (linear)"));
}

TEST(CheckExampleShapeTest, BoundsWhatArrivesOverRpc) {
  EXPECT_TRUE(CheckExampleShape({1, 28, 28}, 64, "input_shape").ok());
  EXPECT_THAT(CheckExampleShape({}, 1, "input_shape").message(),
              HasSubstr("input_shape: 1..8 dimensions"));
  EXPECT_THAT(CheckExampleShape({3, 0, 2}, 1, "input_shape").message(),
              HasSubstr("each dimension in 1..16777216"));
  EXPECT_THAT(CheckExampleShape({1 << 16, 1 << 16}, 1, "input_shape").message(),
              HasSubstr("at most 2^31 elements"));
  EXPECT_THAT(CheckExampleShape({1 << 12, 1 << 12}, 1 << 8, "input_shape").message(),
              HasSubstr("at most 2^31 elements in 256 examples"));
}

}  // namespace
}  // namespace pipemare
