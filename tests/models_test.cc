// Models and data users really train, through real worker processes: a
// ResNet on Fashion-MNIST, a transformer language model on a Debian text
// corpus, a TorchScript file written here, CIFAR-format files written here,
// the profile partition, and what is refused at submit. Label: multiprocess.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/cluster.h"
#include "tests/process.h"

namespace pipemare::testing {
namespace {

// Debian's fortunes package (scripts/dev.sh deps installs it).
constexpr char kCorpus[] = "/usr/share/games/fortunes/cookie";

// The job's epochs, and that its training loss fell from the first to the last.
void ExpectLossFalls(const v1::JobStatus& job) {
  ASSERT_GE(job.epochs_size(), 2);
  const double first = job.epochs(0).train_loss(),
               last = job.epochs(job.epochs_size() - 1).train_loss();
  EXPECT_LT(last, first) << "training loss should fall: " << first << " -> " << last;
  for (const auto& e : job.epochs()) {
    std::printf(
        "epoch %d: train loss %.4f, test loss %.4f, accuracy %.4f, perplexity %.3f, %.1f s\n",
        e.epoch(), e.train_loss(), e.test_loss(), e.test_accuracy(), e.test_perplexity(),
        e.seconds());
  }
}

TEST(Models, ResNet20TrainsOnFashionMnistAcrossFourStages) {
  Cluster cluster(4);
  ASSERT_TRUE(cluster.ok());
  const std::string yaml = absl::StrCat(R"(name: resnet20-fashion
model: {type: resnet, depth: 20}
data: {type: idx, path: )",
                                        FashionMnistDir(), R"(, train_limit: 1536, test_limit: 500}
optimizer: {type: sgd, lr: 0.05, momentum: 0.9}
schedule: {type: pipemare, stages: 4, microbatch_size: 32, lr_anneal_epochs: 1,
           discrepancy_decay: 0.1}
train: {epochs: 2, seed: 1}
)");
  auto submit = cluster.Ctl({"submit", cluster.WriteSpec("resnet", yaml), "--wait"}, 900);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_EQ(job.partition(), "uniform");
  EXPECT_EQ(job.task(), "classification");
  ASSERT_EQ(job.stages_size(), 4);
  int64_t params = 0;
  int units = 0;
  for (const auto& s : job.stages()) {
    params += s.parameters();
    units += s.units();
  }
  EXPECT_EQ(units, 11) << "stem, 9 blocks, head";
  EXPECT_EQ(params, 272474 - 2 * 9 * 16) << "ResNet-20 with a 1-channel stem";
  ExpectLossFalls(job);
  // 60.8% on the machine this was written on, 49.6% on an AMD EPYC (numerics
  // differ by CPU after two short epochs): the bar is "learns", 3x chance.
  EXPECT_GT(job.metrics().test_accuracy(), 0.3) << "ten classes: chance is 0.1";
}

TEST(Models, TransformerLanguageModelTrainsOnATextCorpusOneBlockPerStage) {
  ASSERT_TRUE(std::filesystem::exists(kCorpus))
      << kCorpus << " is missing: install Debian's fortunes (scripts/dev.sh deps does)";
  Cluster cluster(4);
  ASSERT_TRUE(cluster.ok());
  const std::string yaml = absl::StrCat(R"(name: lm-fortunes
model: {type: transformer_lm, depth: 2, width: 64, heads: 4}
data: {type: text, path: )",
                                        kCorpus, R"(, context: 32, test_limit: 200}
optimizer: {type: adam, lr: 0.003}
schedule: {type: pipemare, stages: 4, microbatch_size: 16, discrepancy_decay: 0.1}
train: {epochs: 2, seed: 1}
)");
  auto submit = cluster.Ctl({"submit", cluster.WriteSpec("lm", yaml), "--wait"}, 900);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_EQ(job.task(), "language_model");
  ASSERT_EQ(job.stages_size(), 4);
  for (const auto& s : job.stages()) EXPECT_EQ(s.units(), 1) << "P = blocks + 2";
  ExpectLossFalls(job);
  const double ppl = job.metrics().test_perplexity();
  EXPECT_NEAR(ppl, std::exp(job.metrics().test_loss()), 1e-6 * ppl);
  EXPECT_LT(ppl, 20) << "far below a uniform guess over 256 bytes";
  EXPECT_GT(ppl, 1);
  auto status = cluster.Ctl({"status", "job-1"});
  EXPECT_TRUE(absl::StrContains(status.out, "perplexity")) << status.out;
  const std::string metrics = HttpGet("http://" + cluster.metrics_address() + "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics, "pipemare_job_eval_perplexity{job_id=\"job-1\"}"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "task=\"language_model\"")) << metrics;
}

// A TorchScript nn.Sequential (flatten, linear, relu, linear) written from C++.
void WriteTorchScriptMlp(const std::string& path, bool sequential) {
  torch::jit::Module seq(sequential ? "__torch__.torch.nn.modules.container.Sequential" : "MyNet");
  auto linear = [](const std::string& name, int64_t in, int64_t out) {
    torch::jit::Module m(name);
    torch::manual_seed(in + out);
    m.register_parameter("weight", torch::randn({out, in}) / std::sqrt(double(in)), false);
    m.register_parameter("bias", torch::zeros({out}), false);
    m.define("def forward(self, x):\n    return torch.matmul(x, self.weight.t()) + self.bias\n");
    return m;
  };
  torch::jit::Module flatten("Flatten"), relu("ReLU");
  flatten.define("def forward(self, x):\n    return torch.flatten(x, 1)\n");
  relu.define("def forward(self, x):\n    return torch.relu(x)\n");
  seq.register_module("0", flatten);
  seq.register_module("1", linear("Linear", 784, 128));
  seq.register_module("2", relu);
  seq.register_module("3", linear("Linear", 128, 10));
  seq.save(path);
}

TEST(Models, TorchScriptSequentialTrainsEachChildAUnit) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const std::string model = cluster.dir() + "/mlp.pt";
  WriteTorchScriptMlp(model, true);
  const std::string yaml =
      absl::StrCat("name: torchscript\nmodel: {type: torchscript, path: ", model,
                   "}\ndata: {type: mnist, path: ", MnistDir(), R"(,
       train_limit: 6400, test_limit: 1000}
optimizer: {type: sgd, lr: 0.05, momentum: 0.5}
schedule: {type: pipemare, stages: 2, microbatch_size: 32, partition: split, split: [2]}
train: {epochs: 2, seed: 1}
)");
  auto submit = cluster.Ctl({"submit", cluster.WriteSpec("ts", yaml), "--wait"}, 600);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_EQ(job.partition(), "split");
  ASSERT_EQ(job.stages_size(), 2);
  EXPECT_EQ(job.stages(0).units(), 2);
  EXPECT_EQ(job.stages(0).parameters(), 784 * 128 + 128);
  EXPECT_EQ(job.stages(1).parameters(), 128 * 10 + 10);
  ExpectLossFalls(job);
  EXPECT_GT(job.metrics().test_accuracy(), 0.85);

  // The export is the same TorchScript module with the trained weights:
  // plain PyTorch loads it (torch.jit.load) and scores the job's accuracy.
  const std::string out = cluster.dir() + "/trained.pt";
  auto exported = cluster.Ctl({"export", "job-1", "--out", out});
  ASSERT_EQ(exported.exit_code, 0) << exported.err << cluster.Logs();
  EXPECT_TRUE(absl::StrContains(ReadFile(out + ".json"), "\"torchscript\""))
      << ReadFile(out + ".json");
  EXPECT_NEAR(PythonTestAccuracy(out), job.metrics().test_accuracy(), 0.001)
      << "the exported module holds the weights the job evaluated";
}

// CIFAR-10 binary batches whose label shows in the image: class c is a
// brighter band in rows [3c, 3c + 3) of one channel, on noise.
void WriteCifar(const std::string& path, int records, uint32_t seed) {
  std::mt19937 rng(seed);
  std::ofstream f(path, std::ios::binary);
  for (int r = 0; r < records; ++r) {
    const int label = static_cast<int>(rng() % 10);
    std::vector<unsigned char> rec(3073);
    rec[0] = static_cast<unsigned char>(label);
    for (int c = 0; c < 3; ++c) {
      for (int y = 0; y < 32; ++y) {
        for (int x = 0; x < 32; ++x) {
          int v = static_cast<int>(rng() % 200);
          if (c == label % 3 && y >= 3 * label && y < 3 * label + 3) v += 40;
          rec[1 + c * 1024 + y * 32 + x] = static_cast<unsigned char>(v);
        }
      }
    }
    f.write(reinterpret_cast<const char*>(rec.data()), rec.size());
  }
}

TEST(Models, ConvNetFromALayerListTrainsOnCifarFilesWithTheProfilePartition) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  const std::string dir = cluster.dir();
  WriteCifar(dir + "/data_batch_1.bin", 1200, 1);
  WriteCifar(dir + "/data_batch_2.bin", 400, 2);
  WriteCifar(dir + "/test_batch.bin", 400, 3);
  const std::string yaml = absl::StrCat("name: cifar-profile\ndata: {type: cifar, path: ", dir,
                                        R"(}
model: {type: sequential, units: [
  {type: conv2d, out: 16, kernel: 3, padding: 1}, {type: batchnorm2d}, {type: relu},
  {type: maxpool2d}, {type: conv2d, out: 32, kernel: 3, padding: 1}, {type: relu},
  {type: adaptive_avgpool2d, size: 4}, {type: flatten}, {type: linear, out: 10}]}
optimizer: {type: sgd, lr: 0.05, momentum: 0.5}
schedule: {type: pipemare, stages: 3, microbatch_size: 32, partition: profile,
           lr_anneal_epochs: 1, discrepancy_decay: 0.1}
train: {epochs: 4, seed: 1}
)");
  auto submit = cluster.Ctl({"submit", cluster.WriteSpec("cifar", yaml), "--wait"}, 600);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_EQ(job.partition(), "profile");
  ASSERT_EQ(job.stages_size(), 3);
  int bottlenecks = 0;
  double slowest = 0;
  for (const auto& s : job.stages()) {
    EXPECT_GT(s.predicted_seconds(), 0) << "stage " << s.index();
    slowest = std::max(slowest, s.predicted_seconds());
    bottlenecks += s.bottleneck();
  }
  EXPECT_EQ(bottlenecks, 1);
  for (const auto& s : job.stages()) {
    if (s.bottleneck()) EXPECT_EQ(s.predicted_seconds(), slowest);
  }
  ExpectLossFalls(job);
  EXPECT_GT(job.metrics().test_accuracy(), 0.7) << "the label is in the image";
  auto status = cluster.Ctl({"status", "job-1"});
  EXPECT_TRUE(absl::StrContains(status.out, "bottleneck")) << status.out;
  EXPECT_TRUE(absl::StrContains(status.out, "profile")) << status.out;
  EXPECT_TRUE(absl::StrContains(cluster.coordinator().Log(), "partition profile of 9 units"))
      << cluster.coordinator().Log();
  // Prometheus sees the prediction too, bottleneck marked.
  const std::string metrics = HttpGet("http://" + cluster.metrics_address() + "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics, "pipemare_stage_predicted_seconds{")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "bottleneck=\"true\"")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "partition=\"profile\"")) << metrics;
}

TEST(Models, BadModelsAndDataAreRefusedAtSubmitNamingTheUnitOrFile) {
  Cluster cluster(0);
  ASSERT_FALSE(cluster.address().empty());
  const std::string dir = cluster.dir();
  WriteTorchScriptMlp(dir + "/net.pt", false);
  {
    std::ofstream short_text(dir + "/short.txt");
    short_text << "too short for a context of 64 bytes";
  }
  WriteCifar(dir + "/good.bin", 10, 4);
  {
    std::ofstream cut(dir + "/cut.bin", std::ios::binary);
    cut << std::string(3073 * 2 + 100, '\1');  // two records and a fragment
  }
  const std::string mnist = absl::StrCat("data: {type: mnist, path: ", MnistDir(), "}\n");
  const std::string rest = "optimizer: {lr: 0.05}\ntrain: {epochs: 1}\n";
  struct Case {
    const char* what;
    std::string spec;
    std::vector<std::string> want;  // all must appear in the error
  };
  const std::vector<Case> cases = {
      {"unknown layer type",
       "model: {type: sequential, units: [{type: flatten}, {type: dense, out: 10}]}\n" + mnist +
           "schedule: {type: pipemare, stages: 1}\n",
       {"model.units[1].type", "'dense' is not a layer type"}},
      {"mismatched shapes",
       "model: {type: sequential, units: [{type: flatten}, {type: linear, in: 100, out: 10}]}\n" +
           mnist + "schedule: {type: pipemare, stages: 1}\n",
       {"model.units[1] (linear)", "in: 100", "[B, 784]"}},
      {"a conv on flat input",
       "model: {type: sequential, units: [{type: flatten}, {type: conv2d, out: 4}]}\n" + mnist +
           "schedule: {type: pipemare, stages: 1}\n",
       {"model.units[1] (conv2d)", "expects [B, C, H, W]", "[B, 784]"}},
      {"a unit too large to allocate",
       "model: {type: sequential, units: [{type: flatten}, {type: linear, out: 16000000}, "
       "{type: linear, out: 10}]}\n" +
           mnist + "schedule: {type: pipemare, stages: 1}\n",
       {"model.units[1] (linear)", "would hold 12560000000 parameters"}},
      {"wrong number of classes",
       "model: {type: sequential, units: [{type: flatten}, {type: linear, out: 5}]}\n" + mnist +
           "schedule: {type: pipemare, stages: 1}\n",
       {"model.units[1]", "[B, 5]", "10 classes"}},
      {"split points out of range",
       "model: {type: resnet}\n" + mnist +
           "schedule: {type: pipemare, stages: 3, partition: split, split: [4, 11]}\n",
       {"schedule.split[1]", "11"}},
      {"TorchScript that is not a Sequential",
       "model: {type: torchscript, path: " + dir + "/net.pt}\n" + mnist +
           "schedule: {type: pipemare, stages: 2}\n",
       {"model.path", "not an nn.Sequential"}},
      {"text shorter than one context",
       "model: {type: transformer_lm}\ndata: {type: text, path: " + dir +
           "/short.txt}\nschedule: {type: pipemare, stages: 2}\n",
       {"data.path", "short.txt", "corpus too short"}},
      {"truncated CIFAR file",
       "model: {type: resnet}\ndata: {type: cifar, path: " + dir +
           ", train_files: [good.bin, cut.bin], test_files: [good.bin]}\n"
           "schedule: {type: pipemare, stages: 2}\n",
       {"data.train_files[1]", "cut.bin", "3073"}},
  };
  int i = 0;
  for (const auto& c : cases) {
    const std::string path =
        cluster.WriteSpec(absl::StrCat("bad", i++), "name: bad\n" + c.spec + rest);
    auto r = cluster.Ctl({"submit", path});
    EXPECT_NE(r.exit_code, 0) << c.what;
    for (const auto& w : c.want) {
      EXPECT_TRUE(absl::StrContains(r.err, w)) << c.what << ": wants '" << w << "' in: " << r.err;
    }
  }
  auto list = cluster.Ctl({"list", "--output", "json"});
  EXPECT_FALSE(absl::StrContains(list.out, "\"id\"")) << "no job was created: " << list.out;
  EXPECT_TRUE(cluster.coordinator().Running());
}

}  // namespace
}  // namespace pipemare::testing
