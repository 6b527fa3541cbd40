// bench_harness: trains a job spec's MLP in one process through the
// in-process harness (pipeline/runtime/harness.h), i.e. through the very stage
// executor and runtime the workers run, on the job's own data in the job's
// own order (pipeline/core/training.h), without gRPC or threads. It answers "does
// production differ from the replay, or is this the schedule itself?": the
// same spec through real workers and through here should train alike.
// Prints one JSON line every --every steps and one at the end.
//
//   bench_harness --spec examples/mnist_pipemare.yaml [--seed S] [--epochs E]
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "pipeline/core/data.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/settings.h"
#include "pipeline/core/training.h"
#include "pipeline/runtime/harness.h"

namespace {

void Fail(const absl::Status& st) {
  std::cerr << "error: " << st.message() << std::endl;
  std::exit(2);
}

// Microbatch `j` of `order` (examples [j·B, (j+1)·B)) as flat float inputs
// and class-id targets.
std::pair<torch::Tensor, torch::Tensor> Microbatch(const pipemare::Examples& ex,
                                                   const std::vector<int64_t>& order, int64_t begin,
                                                   int64_t count) {
  const int64_t in = ex.InputSize();
  torch::Tensor x = torch::empty({count, in}, torch::kFloat32);
  torch::Tensor y = torch::empty({count}, torch::kInt64);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t src = order.empty() ? begin + j : order[begin + j];
    std::copy_n(ex.inputs.data() + src * in, in, x.data_ptr<float>() + j * in);
    y[j] = ex.targets[src];
  }
  return {x, y};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_harness: a job's MLP through the in-process harness, on its own data"};
  std::string spec_path;
  int64_t seed = -1, every = 50;
  int epochs = 0, threads = 2;
  app.add_option("--spec", spec_path, "Job spec (an mlp on idx/mnist data)")->required();
  app.add_option("--seed", seed, "Override train.seed");
  app.add_option("--epochs", epochs, "Override train.epochs")->check(CLI::PositiveNumber);
  app.add_option("--every", every, "Print the mean loss every this many steps")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "LibTorch threads")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);

  auto spec = pipemare::LoadJobSpecFile(spec_path);
  if (!spec.ok()) Fail(spec.status());
  if (seed >= 0) spec->mutable_train()->set_seed(seed);
  if (epochs > 0) spec->mutable_train()->set_epochs(epochs);
  pipemare::ApplyJobSpecDefaults(*spec);
  if (auto st = pipemare::ValidateJobSpec(*spec); !st.ok()) Fail(st);
  if (pipemare::ModelKindOf(spec->model().type()) != pipemare::ModelKind::kMlp ||
      pipemare::DataKindOf(spec->data().type()) == pipemare::DataKind::kText) {
    Fail(absl::InvalidArgumentError("model.type: bench_harness runs mlp models on image data"));
  }
  auto data = pipemare::LoadData(spec->data());
  if (!data.ok()) Fail(data.status());
  const int64_t B = spec->schedule().microbatch_size();
  const int N = spec->schedule().microbatches_per_step();
  const int64_t steps_per_epoch = data->train.count / B / N;
  auto h = pipemare::PipelineHarness::Create(*spec, steps_per_epoch);
  if (!h.ok()) Fail(h.status());

  int64_t step = 0, diverged_at = -1;
  for (int epoch = 1; epoch <= spec->train().epochs(); ++epoch) {
    const std::vector<int64_t> order =
        pipemare::EpochOrder(data->train.count, spec->train(), epoch);
    std::vector<torch::Tensor> inputs, targets;
    for (int64_t j = 0; j < steps_per_epoch * N; ++j) {
      auto [x, y] = Microbatch(data->train, order, j * B, B);
      inputs.push_back(x);
      targets.push_back(y);
    }
    auto losses = (*h)->TrainEpoch(inputs, targets);
    if (!losses.ok()) Fail(losses.status());
    double sum = 0;
    for (size_t m = 0; m < losses->size(); ++m) {
      const double loss = (*losses)[m];
      if (!std::isfinite(loss) && diverged_at < 0) diverged_at = step + static_cast<int64_t>(m) / N;
      sum += loss;
      if ((m + 1) % (every * N) == 0) {
        std::cout << "{\"step\": " << step + static_cast<int64_t>(m + 1) / N
                  << ", \"train_loss\": " << sum / (every * N) << "}" << std::endl;
        sum = 0;
      }
    }
    step += steps_per_epoch;
  }
  // Test accuracy: every stage in evaluation mode, microbatches of 256.
  int64_t correct = 0;
  const int P = (*h)->stages();
  for (int64_t b = 0; b < data->test.count; b += 256) {
    auto [x, y] = Microbatch(data->test, {}, b, std::min<int64_t>(256, data->test.count - b));
    for (int i = 0; i + 1 < P; ++i) {
      auto out = (*h)->stage(i).Forward(0, x, /*train=*/false);
      if (!out.ok()) Fail(out.status());
      x = *out;
    }
    auto r = (*h)->stage(P - 1).ForwardLoss(0, x, y, /*train=*/false);
    if (!r.ok()) Fail(r.status());
    correct += r->correct;
  }
  std::cout << "{\"schedule\": \"" << spec->schedule().type()
            << "\", \"seed\": " << spec->train().seed() << ", \"steps\": " << step
            << ", \"diverged_at_step\": " << diverged_at
            << ", \"test_accuracy\": " << static_cast<double>(correct) / data->test.count << "}"
            << std::endl;
  return 0;
}
