#include "pipeline/core/training.h"

#include <algorithm>
#include <numeric>
#include <random>

namespace pipemare {

std::vector<int64_t> EpochOrder(int64_t count, const v1::TrainSpec& train, int epoch) {
  std::vector<int64_t> order(static_cast<size_t>(count));
  std::iota(order.begin(), order.end(), 0);
  if (train.shuffle()) {
    std::mt19937_64 rng(static_cast<uint64_t>(train.seed()) * 7919 + static_cast<uint64_t>(epoch));
    std::shuffle(order.begin(), order.end(), rng);
  }
  return order;
}

}  // namespace pipemare
