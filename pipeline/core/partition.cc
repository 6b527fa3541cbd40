#include "pipeline/core/partition.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pipemare {
namespace {

absl::Status CheckStages(int num_units, int num_stages) {
  if (num_stages < 1) return absl::InvalidArgumentError("schedule.stages: must be >= 1");
  if (num_stages > num_units) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule.stages: ", num_stages, " stages but the model has only ", num_units, " units"));
  }
  return absl::OkStatus();
}

// Checks a cost table: `rows` is 1 (shared by every stage) or num_stages, all
// rows the same length, every cost finite and >= 0.
template <typename T>
absl::Status CheckCosts(const std::vector<std::vector<T>>& cost, int num_stages, const char* what) {
  const size_t units = cost.empty() ? 0 : cost[0].size();
  if (auto s = CheckStages(static_cast<int>(units), num_stages); !s.ok()) return s;
  if (cost.size() != 1 && static_cast<int>(cost.size()) != num_stages) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", cost.size(), " rows for ",
                                                   num_stages, " stages; give one per stage"));
  }
  for (size_t s = 0; s < cost.size(); ++s) {
    if (cost[s].size() != units) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": stage ", s, " has ", cost[s].size(),
                                                     " units, stage 0 has ", units));
    }
    for (size_t u = 0; u < units; ++u) {
      const T c = cost[s][u];
      if (!(c >= 0) || !std::isfinite(static_cast<double>(c))) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": unit ", u, " on stage ", s, " costs ", c, "; costs must be finite and >= 0"));
      }
    }
  }
  return absl::OkStatus();
}

// The min-max contiguous split over a checked cost table (one row, or one per
// stage). Suffix dynamic programs, so the split can be rebuilt front to back:
//   worst[k][i]: the least possible slowest stage when units [i, U) form the
//                last k stages (stages P-k .. P-1);
//   spread[k][i]: with every stage's cost <= the optimum B, the least sum of
//                squared stage sizes of those k stages (-1: impossible).
// A stage's cost is summed left to right, as StageCosts does, so a tie in the
// first program is an exact tie.
template <typename T>
std::vector<StageRange> MinMaxSplit(const std::vector<std::vector<T>>& cost, int P) {
  const int U = static_cast<int>(cost[0].size());
  auto row = [&](int stage) -> const std::vector<T>& { return cost[cost.size() == 1 ? 0 : stage]; };
  const T kNone = std::numeric_limits<T>::max();
  std::vector<std::vector<T>> worst(P + 1, std::vector<T>(U + 1, kNone));
  worst[0][U] = 0;
  for (int k = 1; k <= P; ++k) {
    const std::vector<T>& c = row(P - k);
    for (int i = 0; i < U; ++i) {
      T acc = 0;
      for (int j = i + 1; j <= U; ++j) {
        acc += c[j - 1];
        if (worst[k - 1][j] == kNone) continue;
        const T v = acc > worst[k - 1][j] ? acc : worst[k - 1][j];
        if (v < worst[k][i]) worst[k][i] = v;
      }
    }
  }
  const T best = worst[P][0];

  std::vector<std::vector<int64_t>> spread(P + 1, std::vector<int64_t>(U + 1, -1));
  spread[0][U] = 0;
  for (int k = 1; k <= P; ++k) {
    const std::vector<T>& c = row(P - k);
    for (int i = 0; i < U; ++i) {
      T acc = 0;
      for (int j = i + 1; j <= U; ++j) {
        acc += c[j - 1];
        if (acc > best) break;  // costs are >= 0: longer stages only cost more
        if (spread[k - 1][j] < 0) continue;
        const int64_t v = int64_t{j - i} * (j - i) + spread[k - 1][j];
        if (spread[k][i] < 0 || v < spread[k][i]) spread[k][i] = v;
      }
    }
  }

  // Front to back: each stage ends where the rest stays optimal; on ties, as
  // late as possible (earlier stages get the extra units).
  std::vector<StageRange> ranges;
  int i = 0;
  for (int k = P; k >= 1; --k) {
    const std::vector<T>& c = row(P - k);
    T acc = 0;
    int end = -1;
    int64_t end_spread = 0;
    for (int j = i + 1; j <= U; ++j) {
      acc += c[j - 1];
      if (acc > best) break;
      if (spread[k - 1][j] < 0) continue;
      const int64_t v = int64_t{j - i} * (j - i) + spread[k - 1][j];
      if (end < 0 || v <= end_spread) {
        end = j;
        end_spread = v;
      }
    }
    ranges.push_back({i, end - i});
    i = end;
  }
  return ranges;
}

}  // namespace

absl::StatusOr<std::vector<StageRange>> PartitionUniform(int num_units, int num_stages) {
  if (auto s = CheckStages(num_units, num_stages); !s.ok()) return s;
  std::vector<StageRange> ranges;
  const int base = num_units / num_stages;
  const int extra = num_units % num_stages;
  int next = 0;
  for (int i = 0; i < num_stages; ++i) {
    const int n = base + (i < extra ? 1 : 0);
    ranges.push_back({next, n});
    next += n;
  }
  return ranges;
}

absl::StatusOr<std::vector<StageRange>> PartitionByCost(
    const std::vector<std::vector<double>>& cost, int num_stages) {
  if (num_stages >= 1 && static_cast<int>(cost.size()) != num_stages) {
    return absl::InvalidArgumentError(absl::StrCat("partition cost: ", cost.size(), " rows for ",
                                                   num_stages, " stages; give one per stage"));
  }
  if (auto s = CheckCosts(cost, num_stages, "partition cost"); !s.ok()) return s;
  return MinMaxSplit(cost, num_stages);
}

absl::StatusOr<std::vector<StageRange>> PartitionByCost(const std::vector<double>& cost,
                                                        int num_stages) {
  const std::vector<std::vector<double>> table{cost};
  if (auto s = CheckCosts(table, num_stages, "partition cost"); !s.ok()) return s;
  return MinMaxSplit(table, num_stages);
}

absl::StatusOr<std::vector<StageRange>> PartitionByParameters(const std::vector<int64_t>& params,
                                                              int num_stages) {
  const std::vector<std::vector<int64_t>> table{params};
  if (auto s = CheckCosts(table, num_stages, "partition parameters"); !s.ok()) return s;
  return MinMaxSplit(table, num_stages);
}

absl::StatusOr<std::vector<StageRange>> PartitionFromSplit(const std::vector<int>& split,
                                                           int num_units, int num_stages) {
  if (auto s = CheckStages(num_units, num_stages); !s.ok()) return s;
  if (static_cast<int>(split.size()) != num_stages - 1) {
    return absl::InvalidArgumentError(absl::StrCat("schedule.split: ", split.size(), " points for ",
                                                   num_stages,
                                                   " stages; give stages - 1 = ", num_stages - 1));
  }
  for (size_t i = 0; i < split.size(); ++i) {
    if (split[i] < 1 || split[i] > num_units - 1) {
      return absl::InvalidArgumentError(absl::StrCat("schedule.split[", i, "]: ", split[i],
                                                     " is out of range 1..", num_units - 1,
                                                     " for a model of ", num_units, " units"));
    }
    if (i > 0 && split[i] <= split[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("schedule.split[", i, "]: ", split[i], " is not after schedule.split[",
                       i - 1, "] = ", split[i - 1], "; split points must increase"));
    }
  }
  std::vector<StageRange> ranges;
  int first = 0;
  for (int s = 0; s < num_stages; ++s) {
    const int end = s + 1 < num_stages ? split[s] : num_units;
    ranges.push_back({first, end - first});
    first = end;
  }
  return ranges;
}

std::vector<double> StageCosts(const std::vector<StageRange>& ranges,
                               const std::vector<std::vector<double>>& cost) {
  std::vector<double> out;
  out.reserve(ranges.size());
  for (size_t s = 0; s < ranges.size(); ++s) {
    double acc = 0;
    const size_t r = cost.size() == 1 ? 0 : s;
    if (r < cost.size()) {
      for (int u = ranges[s].first_unit; u < ranges[s].first_unit + ranges[s].units; ++u) {
        if (u >= 0 && static_cast<size_t>(u) < cost[r].size()) acc += cost[r][u];
      }
    }
    out.push_back(acc);
  }
  return out;
}

int Bottleneck(const std::vector<double>& stage_costs) {
  int best = -1;
  for (size_t i = 0; i < stage_costs.size(); ++i) {
    if (best < 0 || stage_costs[i] > stage_costs[best]) best = static_cast<int>(i);
  }
  return best;
}

}  // namespace pipemare
