// bench_delay_tolerance: how much of an asynchronous schedule's gap is the
// optimizer's sensitivity to delay, apart from the pipeline. One process
// trains the fine-grained MLP of bench/convergence.sh (pipeline::BuildUnits,
// same seed and weights) on MNIST with every gradient applied a uniform τ
// steps after it was computed, as if every layer were a stage with delay τ,
// for τ in --taus and each correction of pipeline/core/pipemare_math.h:
//   none  v ← m·v + g, w ← w − α·v (delayed momentum SGD)
//   sc    spike compensation: w ← w − α·(a·v + b·g), a, b = SpikeCompensation(m, τ)
//   lwp   linear weight prediction: the gradient is computed at
//         ŵ = w − τ·α·v (PredictedWeights) instead of w
//   sc+lwp both
//   dc    delay compensation (DC-ASGD, adaptive): the arriving gradient is
//         DelayCompensatedGradient(g, τ·δ, ms, λ0), δ T2's velocity of w
//         (D = 0.1), ms the running mean square of g; --dc-lambda λ0
// τ = 0 is plain momentum SGD (the synchronous reference). Prints one CSV line
// per run: tau,correction,test_accuracy,final_train_loss,diverged.
//
//   bench_delay_tolerance --data data/mnist --taus 0,1,2,4,8 --train-limit 12800
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <deque>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/mnist_mlp.h"
#include "pipeline/core/lr_schedule.h"
#include "pipeline/core/pipemare_math.h"

namespace {

struct Result {
  double accuracy = 0;
  double train_loss = 0;  // mean over the last 50 steps
  bool diverged = false;
};

std::vector<int> ParseList(const std::string& flag, const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    try {
      out.push_back(std::stoi(item));
    } catch (const std::exception&) {
      throw CLI::ValidationError(flag, "'" + item + "' is not an integer");
    }
    if (out.back() < 0 || out.back() > 1000) throw CLI::ValidationError(flag, "each in 0..1000");
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_delay_tolerance: momentum SGD with an injected gradient delay"};
  std::string data = "data/mnist", taus_flag = "0,1,2,4,8",
              corrections_flag = "none,sc,lwp,sc+lwp,dc";
  int depth = 8, width = 128, epochs = 1;
  int64_t microbatch = 64, train_limit = 12800, test_limit = 2000, seed = 1;
  double lr = 0.05, momentum = 0.9, dc_lambda = 2;
  app.add_option("--data", data, "MNIST directory");
  app.add_option("--taus", taus_flag, "delays in steps, comma-separated");
  app.add_option("--corrections", corrections_flag, "none, sc, lwp, sc+lwp, comma-separated");
  app.add_option("--depth", depth, "linear layers (bench/convergence.sh's P)")
      ->check(CLI::Range(2, 64));
  app.add_option("--width", width, "hidden width")->check(CLI::Range(1, 65536));
  app.add_option("--epochs", epochs)->check(CLI::Range(1, 1000));
  app.add_option("--microbatch", microbatch)->check(CLI::Range(1, 65536));
  app.add_option("--train-limit", train_limit, "0 = all")->check(CLI::NonNegativeNumber);
  app.add_option("--test-limit", test_limit, "0 = all")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed);
  app.add_option("--lr", lr, "base rate, cosine to 0 over the run")->check(CLI::PositiveNumber);
  app.add_option("--momentum", momentum)->check(CLI::Range(0.0, 0.999));
  app.add_option("--dc-lambda", dc_lambda, "DC-ASGD's λ0")->check(CLI::PositiveNumber);
  std::vector<int> taus;
  std::vector<std::string> corrections;
  try {
    app.parse(argc, argv);
    taus = ParseList("--taus", taus_flag);
    std::stringstream in(corrections_flag);
    for (std::string c; std::getline(in, c, ',');) {
      if (c != "none" && c != "sc" && c != "lwp" && c != "sc+lwp" && c != "dc") {
        throw CLI::ValidationError("--corrections",
                                   "'" + c + "': allowed none, sc, lwp, sc+lwp, dc");
      }
      corrections.push_back(c);
    }
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  torch::set_num_threads(1);
  auto train = pipemare::LoadMnist(data, true, train_limit);
  auto test = pipemare::LoadMnist(data, false, test_limit);
  if (!train.ok() || !test.ok()) {
    std::cerr << "error: --data: " << (train.ok() ? test.status() : train.status()).message()
              << std::endl;
    return 2;
  }
  pipemare::v1::ModelSpec model;
  model.set_type("mlp");
  model.set_activation("relu");
  model.set_init("he");
  model.add_layers(784);
  for (int i = 0; i < depth - 1; ++i) model.add_layers(width);
  model.add_layers(10);
  const pipemare::bench::SplitTensors training = pipemare::bench::AsTensors(*train);
  const pipemare::bench::SplitTensors testing = pipemare::bench::AsTensors(*test);
  const torch::Tensor& pixels = training.x;
  const torch::Tensor& labels = training.y;
  const int64_t steps_per_epoch = train->count / microbatch;
  pipemare::v1::OptimizerSpec optimizer;
  optimizer.set_lr(lr);
  optimizer.set_lr_schedule("cosine");
  const pipemare::LrSchedule schedule =
      pipemare::LrScheduleFromSpec(optimizer, steps_per_epoch * epochs);

  std::cout << "tau,correction,test_accuracy,final_train_loss,diverged" << std::endl;
  for (int tau : taus) {
    for (const std::string& correction : corrections) {
      const bool sc = correction.find("sc") != std::string::npos;
      const bool lwp = correction.find("lwp") != std::string::npos;
      const bool dc = correction == "dc" && tau > 0;
      auto net = pipemare::bench::BuildMlp(model, seed);
      if (!net.ok()) {
        std::cerr << "error: " << net.status().message() << std::endl;
        return 2;
      }
      torch::nn::Sequential mlp = *net;
      std::vector<torch::Tensor> params = mlp->parameters();
      std::vector<torch::Tensor> v;  // momentum; empty until the first update
      for (const auto& p : params) v.push_back(torch::zeros_like(p));
      std::vector<torch::Tensor> delta, ms;  // DC: T2's velocity of w, mean square of g
      if (dc) {
        for (const auto& p : params) delta.push_back(torch::zeros_like(p));
      }
      const double gamma = pipemare::T2Gamma(0.1, tau);
      bool any_update = false;
      const pipemare::SpikeCoefficients c =
          sc ? pipemare::SpikeCompensation(momentum, tau) : pipemare::SpikeCoefficients{};
      std::deque<std::vector<torch::Tensor>> in_flight;  // gradients not yet applied
      std::deque<double> recent_losses;
      Result result;
      int64_t k = 0;  // updates applied
      double alpha = pipemare::BaseLearningRate(schedule, 0);
      for (int epoch = 1; epoch <= epochs && !result.diverged; ++epoch) {
        std::vector<int64_t> order(train->count);
        std::iota(order.begin(), order.end(), 0);
        std::mt19937_64 rng(static_cast<uint64_t>(seed) * 7919 + epoch);
        std::shuffle(order.begin(), order.end(), rng);
        const torch::Tensor index = torch::from_blob(order.data(), {train->count}, torch::kInt64);
        for (int64_t s = 0; s < steps_per_epoch; ++s) {
          torch::Tensor rows = index.slice(0, s * microbatch, (s + 1) * microbatch);
          torch::Tensor x = pixels.index_select(0, rows);
          torch::Tensor y = labels.index_select(0, rows);
          // The gradient of this microbatch, at w or at the prediction ŵ.
          std::vector<torch::Tensor> live;
          if (lwp && any_update && tau > 0) {
            torch::NoGradGuard no_grad;
            for (size_t j = 0; j < params.size(); ++j) {
              live.push_back(params[j].data());
              params[j].set_data(pipemare::PredictedWeights(live[j], v[j], alpha, tau));
            }
          }
          mlp->zero_grad();
          torch::Tensor loss = torch::nn::functional::cross_entropy(mlp->forward(x), y);
          loss.backward();
          for (size_t j = 0; j < live.size(); ++j) params[j].set_data(live[j]);
          const double value = loss.item<double>();
          if (!std::isfinite(value) || value > 1e6) {
            result.diverged = true;
            break;
          }
          recent_losses.push_back(value);
          if (recent_losses.size() > 50) recent_losses.pop_front();
          std::vector<torch::Tensor> g;
          for (const auto& p : params) g.push_back(p.grad().detach().clone());
          in_flight.push_back(std::move(g));
          if (static_cast<int>(in_flight.size()) <= tau) continue;
          // The gradient computed τ steps ago arrives now.
          const std::vector<torch::Tensor> arrived = std::move(in_flight.front());
          in_flight.pop_front();
          alpha = pipemare::BaseLearningRate(schedule, k);
          torch::NoGradGuard no_grad;
          for (size_t j = 0; j < params.size(); ++j) {
            torch::Tensor g = arrived[j];
            if (dc) {
              const double beta = pipemare::DcMeanSquareDecay();
              if (ms.size() <= j) ms.push_back(g * g);
              ms[j].mul_(beta).addcmul_(g, g, 1 - beta);
              g = pipemare::DelayCompensatedGradient(g, tau * delta[j], ms[j], dc_lambda);
            }
            v[j] = any_update ? momentum * v[j] + g : g.clone();
            const torch::Tensor before = dc ? params[j].detach().clone() : torch::Tensor();
            params[j].sub_(alpha * pipemare::SpikeCompensatedDirection(v[j], g, c));
            if (dc) pipemare::T2VelocityInPlace(delta[j], params[j].detach(), before, gamma);
          }
          any_update = true;
          ++k;
        }
      }
      if (!result.diverged) {
        result.accuracy = pipemare::bench::TestAccuracy(mlp, testing);
        result.train_loss = std::accumulate(recent_losses.begin(), recent_losses.end(), 0.0) /
                            std::max<size_t>(recent_losses.size(), 1);
      }
      std::cout << tau << "," << correction << "," << result.accuracy << "," << result.train_loss
                << "," << (result.diverged ? 1 : 0) << std::endl;
    }
  }
  return 0;
}
