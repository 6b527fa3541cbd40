// α_k, the job's base learning-rate schedule over its optimizer steps (not
// from the paper; PipeMare's T1 rescales it per stage: pipemare_math.h).
//   constant: α_k = lr
//   cosine:   α_k = lr · ½(1 + cos(π · min(k / total_steps, 1)))
//   step:     α_k = lr · gamma^floor(k / step_size)
// times a linear warm-up factor min(1, (k + 1) / warmup_steps) when
// warmup_steps > 0 (the first step runs at lr / warmup_steps).
#ifndef PIPEMARE_PIPELINE_LR_SCHEDULE_H_
#define PIPEMARE_PIPELINE_LR_SCHEDULE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "pipeline/core/settings.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

struct LrSchedule {
  using Kind = LrScheduleKind;
  double lr = 0;
  Kind kind = Kind::kConstant;
  int64_t total_steps = 0;  // cosine
  int64_t step_size = 0;    // step
  double gamma = 0.1;       // step
  int64_t warmup_steps = 0;
};

// From a validated OptimizerSpec (ValidateJobSpec checks the fields).
inline LrSchedule LrScheduleFromSpec(const v1::OptimizerSpec& o, int64_t total_steps) {
  LrSchedule s;
  s.lr = o.lr();
  s.kind = LrScheduleOf(o.lr_schedule());
  s.total_steps = total_steps;
  s.step_size = o.lr_step_size();
  s.gamma = o.has_lr_step_gamma() ? o.lr_step_gamma() : 0.1;
  s.warmup_steps = o.lr_warmup_steps();
  return s;
}

inline double BaseLearningRate(const LrSchedule& s, int64_t k) {
  double alpha = s.lr;
  switch (s.kind) {
    case LrSchedule::Kind::kConstant:
      break;
    case LrSchedule::Kind::kCosine:
      if (s.total_steps > 0) {
        const double progress =
            std::min(static_cast<double>(k) / static_cast<double>(s.total_steps), 1.0);
        alpha = s.lr * 0.5 * (1.0 + std::cos(3.14159265358979323846 * progress));
      }
      break;
    case LrSchedule::Kind::kStep:
      if (s.step_size > 0) alpha = s.lr * std::pow(s.gamma, static_cast<double>(k / s.step_size));
      break;
  }
  if (s.warmup_steps > 0) {
    alpha *= std::min(1.0, static_cast<double>(k + 1) / static_cast<double>(s.warmup_steps));
  }
  return alpha;
}

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_LR_SCHEDULE_H_
