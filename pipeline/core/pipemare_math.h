// PipeMare's formulas, each in one place, named as the paper names them
// (Yang et al., "PipeMare: Asynchronous Pipeline Parallel DNN Training",
// arXiv 1910.05124; see docs/algorithm.md). The tensor formulas are templates
// so that the same line serves torch::Tensor in the stage runtime and double
// in the unit tests that check them against hand-computed values.
#ifndef PIPEMARE_PIPELINE_PIPEMARE_MATH_H_
#define PIPEMARE_PIPELINE_PIPEMARE_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pipemare {

// τ_i: optimizer steps that stage i (0 = input side) of P applies between the
// forward and the backward of one microbatch under asynchronous 1F1B with N
// microbatches per step: ceil((P - 1 - i) / N). Synchronous schedules: 0.
inline int AnalyticDelay(int num_stages, int stage, int microbatches_per_step) {
  const int in_flight_after = num_stages - 1 - stage;
  if (in_flight_after <= 0) return 0;
  return (in_flight_after + microbatches_per_step - 1) / microbatches_per_step;
}

// T1, learning-rate rescheduling: α_{k,i} = α_k · τ_i^-(1 - min(k/K, 1)).
// No change where τ_i <= 1 or K <= 0 (T1 off).
inline double T1LearningRate(double alpha_k, int64_t k, int64_t K, int tau) {
  if (tau <= 1 || K <= 0) return alpha_k;
  const double progress = std::min(static_cast<double>(k) / static_cast<double>(K), 1.0);
  return alpha_k * std::pow(static_cast<double>(tau), -(1.0 - progress));
}

// T2, the velocity decay: γ_i = D^(1/τ_i). Only meaningful for τ_i >= 1.
inline double T2Gamma(double D, int tau) {
  return std::pow(D, 1.0 / static_cast<double>(std::max(tau, 1)));
}

// T2, the velocity update after step t -> t+1:
//   δ_{t+1,i} = γ_i · δ_{t,i} + (1 - γ_i) · (w_{t+1,i} - w_{t,i})
template <typename T>
T T2Velocity(const T& delta_t, const T& w_next, const T& w_t, double gamma) {
  return gamma * delta_t + (1.0 - gamma) * (w_next - w_t);
}

// The same update in place on a tensor (the stage runtime's form: one pass,
// no temporaries): δ ← γ_i · δ + (1 - γ_i) · (w_{t+1} - w_t).
template <typename Tensor>
void T2VelocityInPlace(Tensor& delta, const Tensor& w_next, const Tensor& w_t, double gamma) {
  delta.mul_(gamma).add_(w_next - w_t, 1.0 - gamma);
}

// T2, the backward weights: u_bkwd,i = w_{t,i} - τ_i · δ_{t,i}
template <typename T>
T T2BackwardWeights(const T& w_t, const T& delta_t, int tau) {
  return w_t - static_cast<double>(tau) * delta_t;
}

// Beyond the paper: corrections for optimizers with state, which PipeMare's
// T1 and T2 (derived for plain SGD) leave open (docs/algorithm.md).

// Spike compensation (Kosson et al., "Pipelined Backpropagation at Scale",
// MLSys 2021, arXiv 2003.11666): with momentum m, an undelayed gradient g
// moves the weights by α·m^k·g at the k-th step after it, α·g/(1 − m) in
// all. Arriving τ steps late it has missed the first τ of those terms; the
// compensated update
//   v ← m·v + g,   w ← w − α·(a·v + b·g),   a = m^τ,   b = (1 − m^τ)/(1 − m)
// applies what was missed at once (the spike b·g) and scales the velocity's
// later contributions to α·m^(τ+k)·g, the undelayed ones: in all
// α·g·(b + a/(1 − m)) = α·g/(1 − m). τ = 0 gives a = 1, b = 0 (plain
// momentum, the default below); m = 0 gives a = 0, b = 1 (plain SGD).
struct SpikeCoefficients {
  double a = 1;
  double b = 0;
};
inline SpikeCoefficients SpikeCompensation(double m, int tau) {
  SpikeCoefficients c;
  c.a = std::pow(m, static_cast<double>(std::max(tau, 0)));
  // (1 − m^τ)/(1 − m) = 1 + m + … + m^(τ−1), summed so that m = 1 is exact.
  c.b = 0;
  double power = 1;
  for (int k = 0; k < tau; ++k, power *= m) c.b += power;
  return c;
}

// Linear weight prediction (Kosson et al. 2021, §4.2; for Adam as in XPipe,
// Guan et al. 2019): a forward whose backward comes τ steps later runs at
//   ŵ = w − τ·α·d
// where d is the optimizer's current update direction: the momentum buffer v
// for SGD, m̂/(√v̂ + ε) for Adam (AdamDirection). If the next τ steps move w as
// the last one did, the backward then differentiates at about the weights
// its forward used, which is what T2 approximates from the other side.
template <typename T>
T PredictedWeights(const T& w, const T& d, double alpha, int tau) {
  return w - (static_cast<double>(tau) * alpha) * d;
}

// Adam's update direction after `step` steps from its moments m and v:
//   m̂/(√v̂ + ε), m̂ = m/(1 − β1^step), v̂ = v/(1 − β2^step).
template <typename T>
T AdamDirection(const T& m, const T& v, int64_t step, double beta1, double beta2, double eps) {
  using std::sqrt;  // and at::sqrt for tensors, by argument-dependent lookup
  const double c1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double c2 = 1 - std::pow(beta2, static_cast<double>(step));
  return (m / c1) / (sqrt(v / c2) + eps);
}

// The compensated update direction a·v + b·g.
template <typename T>
T SpikeCompensatedDirection(const T& v, const T& g, const SpikeCoefficients& c) {
  return c.a * v + c.b * g;
}

// Delay compensation (DC-ASGD, Zheng et al., "Asynchronous Stochastic
// Gradient Descent with Delay Compensation", ICML 2017, arXiv 1609.08326),
// adaptive form: a gradient g computed at the forward's weights w_fwd and
// applied at w_now is corrected by the first-order Taylor term, with the
// Hessian approximated by λ·g⊙g:
//   g̃ = g + λ ⊙ g ⊙ g ⊙ (w_now − w_fwd),   λ = λ0 / (√ms + ε)
// where ms is the running mean square of g (Adam's v̂; for SGD the stage's
// own, β = DcMeanSquareDecay()). The displacement is not stored: it is
// τ_i·δ_i, T2's velocity times the delay (T2BackwardWeights' correction).
template <typename T>
T DelayCompensatedGradient(const T& g, const T& displacement, const T& mean_square, double lambda0,
                           double eps = 1e-7) {
  using std::sqrt;  // and at::sqrt for tensors, by argument-dependent lookup
  return g + (lambda0 / (sqrt(mean_square) + eps)) * g * g * displacement;
}
// ms ← β·ms + (1 − β)·g², β as in Zheng et al.
inline double DcMeanSquareDecay() { return 0.95; }

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_PIPEMARE_MATH_H_
