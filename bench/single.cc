// bench_single: the baseline of bench/single.sh. Trains the very MLP a
// Pipemare job builds (pipeline::BuildUnits, same seed, same initial
// weights) on MNIST in one process with plain LibTorch: no pipeline, no
// gRPC, SGD on each microbatch. Prints one JSON line with samples/s (training
// time only, as the coordinator reports it) and the test accuracy.
//
//   bench_single --data data/mnist --layers 784,512,512,256,10 --threads 2
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/mnist_mlp.h"
#include "pipeline/runtime/stage_runtime.h"

int main(int argc, char** argv) {
  CLI::App app{"bench_single: one-process LibTorch baseline for bench/single.sh"};
  std::string data = "data/mnist", layers_flag = "784,512,512,256,10";
  int threads = 2, epochs = 1;
  int64_t microbatch = 64, train_limit = 0, test_limit = 0, seed = 1;
  double lr = 0.03, momentum = 0.9;
  app.add_option("--data", data, "MNIST directory");
  app.add_option("--layers", layers_flag, "MLP widths, input first, comma-separated");
  app.add_option("--threads", threads, "LibTorch intra-op threads")->check(CLI::Range(1, 256));
  app.add_option("--epochs", epochs)->check(CLI::Range(1, 1000));
  app.add_option("--microbatch", microbatch)->check(CLI::Range(1, 65536));
  app.add_option("--train-limit", train_limit, "0 = all")->check(CLI::NonNegativeNumber);
  app.add_option("--test-limit", test_limit, "0 = all")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed);
  app.add_option("--lr", lr)->check(CLI::PositiveNumber);
  app.add_option("--momentum", momentum)->check(CLI::Range(0.0, 1.0));
  CLI11_PARSE(app, argc, argv);

  pipemare::v1::ModelSpec model;
  model.set_type("mlp");
  model.set_activation("relu");
  std::stringstream widths(layers_flag);
  for (std::string w; std::getline(widths, w, ',');) {
    try {
      model.add_layers(std::stoll(w));
    } catch (const std::exception&) {
      std::cerr << "error: --layers: '" << w << "' is not an integer" << std::endl;
      return 2;
    }
  }
  if (model.layers_size() < 2) {
    std::cerr << "error: --layers: give at least two widths, e.g. 784,10" << std::endl;
    return 2;
  }
  torch::set_num_threads(threads);
  auto train = pipemare::LoadMnist(data, true, train_limit);
  auto test = pipemare::LoadMnist(data, false, test_limit);
  if (!train.ok() || !test.ok()) {
    std::cerr << "error: --data: " << (train.ok() ? test.status() : train.status()).message()
              << std::endl;
    return 2;
  }
  auto net = pipemare::bench::BuildMlp(model, seed);
  if (!net.ok()) {
    std::cerr << "error: --layers: " << net.status().message() << std::endl;
    return 2;
  }
  torch::nn::Sequential mlp = *net;
  torch::optim::SGD sgd(mlp->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
  const pipemare::bench::SplitTensors training = pipemare::bench::AsTensors(*train);
  const torch::Tensor& pixels = training.x;
  const torch::Tensor& labels = training.y;
  double train_seconds = 0;
  int64_t samples = 0;
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    std::vector<int64_t> order(train->count);
    std::iota(order.begin(), order.end(), 0);
    std::mt19937_64 rng(static_cast<uint64_t>(seed) * 7919 + epoch);
    std::shuffle(order.begin(), order.end(), rng);
    const torch::Tensor index = torch::from_blob(order.data(), {train->count}, torch::kInt64);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t b = 0; b + microbatch <= train->count; b += microbatch) {
      // Gathering a microbatch is a copy, as the coordinator's feed makes one.
      torch::Tensor rows = index.slice(0, b, b + microbatch);
      torch::Tensor x = pixels.index_select(0, rows);
      torch::Tensor y = labels.index_select(0, rows);
      sgd.zero_grad();
      torch::nn::functional::cross_entropy(mlp->forward(x), y).backward();
      sgd.step();
      samples += microbatch;
    }
    train_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const double accuracy = pipemare::bench::TestAccuracy(mlp, pipemare::bench::AsTensors(*test));
  std::cout << "{\"samples_per_second\": " << samples / train_seconds
            << ", \"train_seconds\": " << train_seconds << ", \"test_accuracy\": " << accuracy
            << ", \"threads\": " << threads << "}" << std::endl;
  return 0;
}
