#include "pipeline/runtime/stage_runtime.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/lr_schedule.h"
#include "pipeline/core/pipemare_math.h"
#include "pipeline/core/settings.h"
#include "pipeline/model/model.h"

namespace pipemare {
namespace {

absl::Status Bad(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// Runs `fn`, turning LibTorch's exceptions into a Status at this boundary.
template <typename Fn>
absl::Status Guard(const char* what, Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", e.what_without_backtrace()));
  } catch (const std::invalid_argument& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

// The virtual device's stand-in for compute.
void Busy(double seconds) {
  if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

}  // namespace

absl::StatusOr<VirtualDevice> ParseVirtualDevice(const std::string& text, const std::string& flag) {
  std::vector<double> ms;
  bool ok = true;
  for (size_t start = 0; ok && start <= text.size();) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    const std::string part = text.substr(start, comma - start);
    char* end = nullptr;
    const double v = std::strtod(part.c_str(), &end);
    ok = !part.empty() && end == part.c_str() + part.size() && std::isfinite(v) && v >= 0;
    ms.push_back(v);
    start = comma + 1;
  }
  if (!ok || ms.size() < 2 || ms.size() > 3) {
    return Bad(flag,
               absl::StrCat("'", text,
                            "' is not FWD_MS,BWD_MS[,W_MS] (milliseconds of forward, backward and "
                            "weight gradient per unit, each >= 0), e.g. 2,4 or 2,2,2"));
  }
  if (ms.size() == 3)
    return VirtualDevice{true, ms[0] / 1000, (ms[1] + ms[2]) / 1000, ms[2] / 1000};
  return VirtualDevice{true, ms[0] / 1000, ms[1] / 1000, ms[1] / 2000};
}

absl::StatusOr<std::unique_ptr<StageRuntime>> StageRuntime::Create(const v1::StageAssignment& a,
                                                                   torch::Device device,
                                                                   torch::Dtype dtype,
                                                                   VirtualDevice virtual_device) {
  if (a.num_stages() < 1) return Bad("num_stages", "must be >= 1");
  if (a.stage() < 0 || a.stage() >= a.num_stages()) {
    return Bad("stage", absl::StrCat(a.stage(), " is not in 0..", a.num_stages() - 1));
  }
  auto kind = ParseScheduleKind(a.schedule().type());
  if (!kind.ok()) return kind.status();
  // The worker's edge: the coordinator sends a defaulted spec, and an empty
  // type or lr_schedule reads as its default (settings.h) here too.
  if (auto st = ValidateOptimizerSpec(a.optimizer()); !st.ok()) return st;
  if (a.schedule().microbatches_per_step() < 1) {
    return Bad("schedule.microbatches_per_step", "must be >= 1");
  }
  const std::vector<int64_t> input_shape(a.input_shape().begin(), a.input_shape().end());
  if (!input_shape.empty()) {  // empty: an MLP stage, sized by model.layers below
    if (auto st = CheckExampleShape(input_shape, 1, "input_shape"); !st.ok()) return st;
  }
  TensorType input{input_shape, a.token_input()};
  // An MLP's stage input is a flat vector of its first layer's width.
  if (input.shape.empty() && ModelKindOf(a.model().type()) == ModelKind::kMlp &&
      a.first_unit() < a.model().layers_size()) {
    input.shape = {a.model().layers(a.first_unit())};
  }
  // Builds the stage's units afresh (also for the copies a kept graph runs
  // on, whose weights are then overwritten).
  auto build = [model = a.model(), first = a.first_unit(), units = a.units(), seed = a.seed(),
                input, torchscript = a.torchscript(), device, dtype] {
    auto m = BuildUnits(model, first, units, seed, input, torchscript);
    if (!m.ok()) throw std::invalid_argument(std::string(m.status().message()));
    m->module->to(device, dtype);
    return m->module;
  };
  torch::nn::Sequential module;
  absl::Status built = Guard("building the stage", [&] { module = build(); });
  if (!built.ok()) return built;
  return std::unique_ptr<StageRuntime>(
      new StageRuntime(a, *kind, module, std::move(build), device, virtual_device));
}

namespace {

// The stage's optimizer over its own parameters (a validated spec).
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const v1::OptimizerSpec& o,
                                                       std::vector<torch::Tensor> params) {
  const double beta1 = o.has_beta1() ? o.beta1() : 0.9;
  const double beta2 = o.has_beta2() ? o.beta2() : 0.999;
  const double eps = o.has_eps() ? o.eps() : 1e-8;
  if (OptimizerOf(o.type()) == OptimizerKind::kAdam) {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr())
                                                            .betas(std::make_tuple(beta1, beta2))
                                                            .eps(eps)
                                                            .weight_decay(o.weight_decay()));
  }
  if (OptimizerOf(o.type()) == OptimizerKind::kAdamW) {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(o.lr())
                                                             .betas(std::make_tuple(beta1, beta2))
                                                             .eps(eps)
                                                             .weight_decay(o.weight_decay()));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr())
                                                         .momentum(o.momentum())
                                                         .weight_decay(o.weight_decay())
                                                         .nesterov(o.nesterov()));
}

}  // namespace

StageRuntime::StageRuntime(const v1::StageAssignment& a, ScheduleKind kind,
                           torch::nn::Sequential module,
                           std::function<torch::nn::Sequential()> build, torch::Device device,
                           VirtualDevice virtual_device)
    : stage_(a.stage()),
      num_stages_(a.num_stages()),
      kind_(kind),
      microbatches_per_step_(a.schedule().microbatches_per_step()),
      tau_(!IsAsynchronous(kind) ? 0
           : kind == ScheduleKind::kPipeDream2BW
               ? 1
               : AnalyticDelay(a.num_stages(), a.stage(), a.schedule().microbatches_per_step())),
      lr_schedule_(LrScheduleFromSpec(a.optimizer(), a.total_steps())),
      grad_clip_norm_(a.optimizer().grad_clip_norm()),
      lr_anneal_steps_(kind == ScheduleKind::kPipeMare ? a.lr_anneal_steps() : 0),
      warmup_steps_(IsAsynchronous(kind) ? std::max<int64_t>(a.warmup_steps(), 0) : 0),
      t2_enabled_(kind == ScheduleKind::kPipeMare && a.schedule().has_discrepancy_decay() &&
                  a.schedule().discrepancy_decay() >= 0 && tau_ >= 1),
      // D for T2, and for the δ that delay compensation keeps (0.1 unset).
      t2_gamma_(
          T2Gamma(a.schedule().has_discrepancy_decay() && a.schedule().discrepancy_decay() >= 0
                      ? a.schedule().discrepancy_decay()
                      : 0.1,
                  tau_)),
      spike_enabled_(a.schedule().spike_compensation() && tau_ > 0 &&
                     OptimizerOf(a.optimizer().type()) == OptimizerKind::kSgd),
      spike_(SpikeCompensation(a.optimizer().momentum(), tau_)),
      predict_enabled_(a.schedule().weight_prediction() && tau_ > 0),
      dc_enabled_(a.schedule().delay_compensation() > 0 && tau_ > 0),
      dc_lambda_(a.schedule().delay_compensation()),
      stashing_(kind == ScheduleKind::kPipeDream && tau_ > 0 && Recomputes(a.schedule())),
      two_versions_(kind == ScheduleKind::kPipeDream2BW),
      recompute_(Recomputes(a.schedule())),
      split_(SplitsBackward(kind)),
      device_(device),
      first_unit_(a.first_unit()),
      units_(a.units()),
      virtual_(virtual_device),
      module_(std::move(module)),
      build_(std::move(build)) {
  optimizer_ = MakeOptimizer(a.optimizer(), module_->parameters());
  int64_t params = 0;
  for (const auto& p : module_->parameters()) {
    params += p.numel();
    if (TracksVelocity()) velocity_.push_back(torch::zeros_like(p));
  }
  absl::MutexLock lock(&stats_mu_);
  stats_.parameters = params;
  stats_.analytic_delay = tau_;
  stats_.learning_rate = warmup_steps_ > 0 ? BaseLearningRate(lr_schedule_, 0)
                                           : T1LearningRate(BaseLearningRate(lr_schedule_, 0), 0,
                                                            lr_anneal_steps_, tau_);
  UpdateMemoryLocked();
}

namespace {
int64_t Bytes(const torch::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

// Adam's and AdamW's per-parameter state and options are distinct LibTorch
// types with the same fields: one read of either, or nullopt for another
// optimizer's state (SGD's).
struct AdamState {
  torch::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
  int64_t step = 0;
  double beta1 = 0, beta2 = 0, eps = 0;
};
std::optional<AdamState> AdamStateOf(const torch::optim::OptimizerParamState* s,
                                     const torch::optim::OptimizerOptions& options) {
  auto read = [](const auto& state, const auto& o) {
    return AdamState{state.exp_avg(), state.exp_avg_sq(),     state.max_exp_avg_sq(),
                     state.step(),    std::get<0>(o.betas()), std::get<1>(o.betas()),
                     o.eps()};
  };
  if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
    return read(*adam, static_cast<const torch::optim::AdamOptions&>(options));
  }
  if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
    return read(*adamw, static_cast<const torch::optim::AdamWOptions&>(options));
  }
  return std::nullopt;
}
}  // namespace

void StageRuntime::UpdateMemoryLocked() {
  StageMemory m;
  for (const auto& p : module_->parameters()) m.weights += Bytes(p);
  for (const auto& b : module_->buffers()) m.weights += Bytes(b);
  for (const auto& v : velocity_) m.t2_velocity += Bytes(v);
  for (const auto& v : dc_mean_square_) m.optimizer_state += Bytes(v);
  for (const auto& kv : optimizer_->state()) {
    const torch::optim::OptimizerParamState* s = kv.second.get();
    if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      m.optimizer_state += Bytes(sgd->momentum_buffer());
    } else if (auto adam = AdamStateOf(s, optimizer_->param_groups()[0].options())) {
      m.optimizer_state +=
          Bytes(adam->exp_avg) + Bytes(adam->exp_avg_sq) + Bytes(adam->max_exp_avg_sq);
    }
  }
  std::set<const void*> copies;  // stage copies a kept graph runs on, counted once
  if (two_bw_copy_) {
    copies.insert(two_bw_copy_.get());
    for (const auto& p : two_bw_copy_->parameters()) m.stash += Bytes(p);
  }
  for (const auto& kv : saved_) {
    const Saved& saved = kv.second;
    m.saved_activations += Bytes(saved.input) + Bytes(saved.targets) + Bytes(saved.output);
    if (saved.copy && copies.insert(saved.copy.get()).second) {
      for (const auto& p : saved.copy->parameters()) m.stash += Bytes(p);
    }
  }
  for (const auto& kv : stash_) {
    for (const auto& w : kv.second.weights) m.stash += Bytes(w);
  }
  stats_.memory = m;
  StageMemory& peak = stats_.peak_memory;
  peak.weights = std::max(peak.weights, m.weights);
  peak.optimizer_state = std::max(peak.optimizer_state, m.optimizer_state);
  peak.t2_velocity = std::max(peak.t2_velocity, m.t2_velocity);
  peak.stash = std::max(peak.stash, m.stash);
  peak.saved_activations = std::max(peak.saved_activations, m.saved_activations);
  stats_.stashed_versions = static_cast<int64_t>(stash_.size() + copies.size());
  stats_.in_flight = static_cast<int64_t>(saved_.size());
}

namespace {

// Points a module's parameters at other tensors (a prediction, T2's u_bkwd,
// a stash) and back at their own storage on every exit, also when an
// exception passes: the live weights themselves are never written.
class SwappedWeights {
 public:
  explicit SwappedWeights(std::vector<torch::Tensor> params) : params_(std::move(params)) {}
  ~SwappedWeights() {
    for (size_t j = 0; j < live_.size(); ++j) params_[j].set_data(live_[j]);
  }
  SwappedWeights(const SwappedWeights&) = delete;
  SwappedWeights& operator=(const SwappedWeights&) = delete;
  // Once; `to` holds one tensor per parameter, or none (no swap).
  void PointAt(const std::vector<torch::Tensor>& to) {
    torch::NoGradGuard no_grad;
    for (size_t j = 0; j < to.size(); ++j) {
      live_.push_back(params_[j].data());
      params_[j].set_data(to[j]);
    }
  }

 private:
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> live_;  // the parameters' own storage while swapped
};

// The optimizer's key for parameter `p`: a string in LibTorch 1.x, the
// TensorImpl's address in 2.x.
template <typename Map>
typename Map::key_type OptimizerStateKey(const Map&, const torch::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

}  // namespace

absl::StatusOr<torch::Tensor> StageRuntime::Forward(uint64_t microbatch, const torch::Tensor& input,
                                                    bool train) {
  if (train && saved_.count(microbatch)) {
    return absl::InvalidArgumentError(absl::StrCat("microbatch ", microbatch, " forwarded twice"));
  }
  torch::Tensor rng;
  if (train) rng = RngState();
  const int64_t version = train && two_versions_ ? TwoBwVersion() : step_;
  // Weight prediction: the forward runs at ŵ, as the backward runs at u_bkwd.
  // Remember (below) stashes the weights as this forward saw them, so
  // pipedream's backward differentiates at ŵ too. pipedream_2bw's forward
  // runs at its version.
  SwappedWeights swapped(module_->parameters());
  if (train && !virtual_.enabled) {
    const std::vector<torch::Tensor>* at = two_versions_ ? VersionWeights(version) : nullptr;
    absl::Status st = Guard(absl::StrCat("stage ", stage_, " forward weights").c_str(), [&] {
      if (predict_enabled_) swapped.PointAt(PredictWeights());
      if (at != nullptr) swapped.PointAt(*at);
    });
    if (!st.ok()) return st;
  }
  const bool keep = train && !recompute_ && !virtual_.enabled;
  Saved graph;
  auto out = Run(input, train, keep ? &graph : nullptr, version);
  if (out.ok() && train) {
    if (two_versions_) ++train_forwards_;
    graph.input = input;
    graph.step = version;
    graph.rng = rng;
    Remember(microbatch, std::move(graph));
  }
  return out;
}

std::shared_ptr<torch::nn::SequentialImpl> StageRuntime::CopyOfStage() {
  // Building draws initial weights from the default generators (seeded per
  // unit): their state, which dropout draws from, is put back.
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  torch::Tensor cpu_state;
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu_state = cpu.get_state();
  }
  const torch::Tensor device_state = device_.is_cuda() ? RngState() : torch::Tensor();
  torch::nn::Sequential copy = build_();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(cpu_state);
  }
  if (device_state.defined()) SetRngState(device_state);
  torch::NoGradGuard no_grad;
  auto from = module_->parameters(), to = copy->parameters();
  for (size_t j = 0; j < to.size(); ++j) to[j].copy_(from[j]);
  auto from_buffers = module_->buffers(), to_buffers = copy->buffers();
  for (size_t j = 0; j < to_buffers.size(); ++j) to_buffers[j].copy_(from_buffers[j]);
  return copy.ptr();
}

int64_t StageRuntime::TwoBwVersion() const {
  // Microbatch k (0-based, since the start) belongs to step k / N; during a
  // warm-up it runs at that step's weights, after it at the step before's.
  const int64_t s = train_forwards_ / microbatches_per_step_;
  if (s < warmup_steps_) return s;
  return std::max(s - 1, first_version_);
}

const std::vector<torch::Tensor>* StageRuntime::VersionWeights(int64_t version) const {
  if (version == step_) return nullptr;
  auto it = stash_.find(version);
  return it == stash_.end() ? nullptr : &it->second.weights;
}

std::vector<torch::Tensor> StageRuntime::PredictWeights() {
  double alpha;
  {
    absl::MutexLock lock(&stats_mu_);
    if (stats_.steps < std::max<int64_t>(warmup_steps_, 1)) return {};
    alpha = stats_.learning_rate;
  }
  torch::NoGradGuard no_grad;
  auto params = module_->parameters();
  auto& state = optimizer_->state();
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    auto it = state.find(OptimizerStateKey(state, p));
    torch::Tensor d;
    if (it != state.end()) {
      const torch::optim::OptimizerParamState* s = it->second.get();
      if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
        d = sgd->momentum_buffer();
      } else if (auto adam = AdamStateOf(s, optimizer_->param_groups()[0].options())) {
        d = AdamDirection(adam->exp_avg, adam->exp_avg_sq, adam->step, adam->beta1, adam->beta2,
                          adam->eps);
      }
    }
    out.push_back(d.defined() ? PredictedWeights(p.detach(), d, alpha, tau_) : p.detach());
  }
  return out;
}

namespace {
// The generator dropout draws from on `device`.
at::Generator DefaultGenerator(const torch::Device& device) {
  return device.is_cuda() ? at::globalContext().defaultGenerator(device)
                          : at::detail::getDefaultCPUGenerator();
}
}  // namespace

std::string RngKey(const torch::Device& device) {
  return device.is_cuda() ? "rng/cuda_state" : "rng/state";
}

torch::Tensor StageRuntime::RngState() const {
  if (virtual_.enabled) return torch::Tensor();
  at::Generator gen = DefaultGenerator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void StageRuntime::SetRngState(const torch::Tensor& state) {
  at::Generator gen = DefaultGenerator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

absl::StatusOr<torch::Tensor> StageRuntime::Run(const torch::Tensor& input, bool train,
                                                Saved* graph, int64_t version) {
  torch::Tensor out;
  absl::Status st = Guard(absl::StrCat("stage ", stage_, " forward").c_str(), [&] {
    if (graph != nullptr) {
      // An update may come before the backward (pipedream on a stage with
      // τ_i > 0, pipedream_2bw, after any warm-up): the graph runs on a copy
      // of the stage at the forward's weights, which no step writes. One
      // copy per version.
      std::shared_ptr<torch::nn::SequentialImpl> m = module_.ptr();
      const int64_t step = two_versions_ ? train_forwards_ / microbatches_per_step_ : step_;
      if ((two_versions_ || (IsAsynchronous(kind_) && tau_ > 0)) && step >= warmup_steps_) {
        std::shared_ptr<torch::nn::SequentialImpl> copy = copy_.lock();
        if (!copy || copy_version_ != version) {
          if (version != step_) {
            throw std::logic_error(absl::StrCat("no copy of weight version ", version));
          }
          // The live parameters hold the forward's weights now (swapped in
          // for a prediction): the copy takes them.
          copy = CopyOfStage();
          copy_ = copy;
          copy_version_ = version;
        }
        m = copy;
        torch::NoGradGuard no_grad;
        auto from = module_->buffers(), to = m->buffers();
        for (size_t j = 0; j < to.size(); ++j) to[j].copy_(from[j]);
      }
      torch::Tensor x = input.to(device_).detach();
      if (!is_first()) x.requires_grad_(true);
      m->train(true);
      torch::Tensor y = m->forward(x);
      if (m != module_.ptr()) {
        torch::NoGradGuard no_grad;
        auto from = m->buffers(), to = module_->buffers();
        for (size_t j = 0; j < to.size(); ++j) to[j].copy_(from[j]);
        graph->copy = m;
      }
      graph->x = x;
      graph->output = y;
      out = y.detach();
      return;
    }
    torch::NoGradGuard no_grad;
    if (!virtual_.enabled) {
      // Training forwards use batch statistics and dropout; evaluation the
      // running statistics and no dropout.
      module_->train(train);
      out = module_->forward(input.to(device_));
      return;
    }
    // One real forward per input shape learns (and checks) the output shape.
    const std::vector<int64_t> in_shape = input.sizes().vec();
    auto shape = virtual_out_.find(in_shape);
    if (shape == virtual_out_.end()) {
      torch::Tensor probe = module_->forward(torch::zeros_like(input).to(device_));
      shape =
          virtual_out_
              .emplace(in_shape, torch::zeros(probe.sizes(), module_->parameters()[0].options()))
              .first;
    }
    Busy(virtual_.forward_seconds_per_unit * units_);
    out = shape->second;  // shared and never written: no allocation per microbatch
  });
  if (!st.ok()) return st;
  return out;
}

void StageRuntime::Remember(uint64_t microbatch, Saved saved) {
  const int64_t version = saved.step;
  std::vector<torch::Tensor> weights;
  if (stashing_ && !stash_.count(version)) {
    torch::NoGradGuard no_grad;
    for (const auto& p : module_->parameters()) weights.push_back(p.detach().clone());
  }
  saved.input = saved.input.to(device_);
  if (saved.targets.defined()) saved.targets = saved.targets.to(device_);
  absl::MutexLock lock(&stats_mu_);
  saved_[microbatch] = std::move(saved);
  if (stashing_) {
    Stash& stash = stash_[version];
    if (stash.weights.empty()) stash.weights = std::move(weights);
    ++stash.users;
  }
  ++stats_.forwards;
  UpdateMemoryLocked();
}

namespace {

// Cross-entropy of logits [B, ..., C] against class ids [B, ...]: one class
// per example (classification) or per position (language models).
torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

}  // namespace

absl::StatusOr<LossResult> StageRuntime::ForwardLoss(uint64_t microbatch,
                                                     const torch::Tensor& input,
                                                     const torch::Tensor& targets, bool train) {
  if (!is_last()) return absl::FailedPreconditionError("ForwardLoss on a stage that is not last");
  if (targets.dim() < 1 || input.dim() < 1 || targets.size(0) != input.size(0) ||
      targets.scalar_type() != torch::kInt64) {
    return absl::InvalidArgumentError(absl::StrCat("targets of microbatch ", microbatch,
                                                   " must be INT64 of shape [",
                                                   input.dim() ? input.size(0) : 0, ", ...]"));
  }
  if (train && saved_.count(microbatch)) {
    return absl::InvalidArgumentError(absl::StrCat("microbatch ", microbatch, " forwarded twice"));
  }
  torch::Tensor rng;
  if (train) rng = RngState();
  const int64_t version = train && two_versions_ ? TwoBwVersion() : step_;
  SwappedWeights swapped(module_->parameters());
  if (train && two_versions_ && !virtual_.enabled) {
    if (const auto* at = VersionWeights(version)) {
      absl::Status st = Guard("forward weights", [&] { swapped.PointAt(*at); });
      if (!st.ok()) return st;
    }
  }
  const bool keep = train && !recompute_ && !virtual_.enabled;
  Saved graph;
  auto out = Run(input, train, keep ? &graph : nullptr, version);
  if (!out.ok()) return out.status();
  LossResult r;
  absl::Status st = Guard("loss", [&] {
    const auto want = out->sizes().slice(0, out->dim() - 1);
    if (out->dim() < 2 || !targets.sizes().equals(want)) {
      throw std::invalid_argument(absl::StrCat(
          "targets of shape ", c10::str(targets.sizes()), " do not match the model's output ",
          c10::str(out->sizes()), " (logits: one class dimension last)"));
    }
    const int64_t classes = out->size(-1);
    if (targets.numel() > 0 &&
        (targets.min().item<int64_t>() < 0 || targets.max().item<int64_t>() >= classes)) {
      throw std::invalid_argument(absl::StrCat("targets outside 0..", classes - 1));
    }
    torch::Tensor t = targets.to(device_);
    if (keep) {
      // The graph's output is the loss the backward differentiates.
      torch::Tensor loss = Loss(graph.output, t);
      r.loss = loss.item<double>();
      graph.output = loss / static_cast<double>(microbatches_per_step_);
    } else {
      r.loss = Loss(*out, t).item<double>();
    }
    r.correct = out->argmax(-1).eq(t).sum().item<int64_t>();
    r.count = targets.size(0);
    r.predictions = targets.numel();
  });
  if (!st.ok()) return st;
  if (train) {  // once the loss is known to be computable
    if (two_versions_) ++train_forwards_;
    graph.input = input;
    graph.targets = targets;
    graph.step = version;
    graph.rng = rng;
    Remember(microbatch, std::move(graph));
  }
  return r;
}

const std::vector<torch::Tensor>* StageRuntime::StashedWeights(const Saved& saved) const {
  // No update since the forward: the live weights are the forward's, unless
  // it ran at a prediction (then the stash holds that).
  if (two_versions_) return VersionWeights(saved.step);
  if (!stashing_ || (saved.step == step_ && !predict_enabled_)) return nullptr;
  return &stash_.at(saved.step).weights;
}

bool StageRuntime::CorrectsDiscrepancy() const { return t2_enabled_ && step_ >= warmup_steps_; }

absl::StatusOr<torch::Tensor> StageRuntime::Backward(uint64_t microbatch,
                                                     const torch::Tensor& grad_output) {
  auto it = saved_.find(microbatch);
  if (it == saved_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient for microbatch ", microbatch, " that this stage has not forwarded"));
  }
  if (!grad_output.defined() && !is_last()) {
    return absl::InvalidArgumentError("missing gradient on a stage that is not last");
  }
  Saved& saved = it->second;
  if (saved.input_gradient_done) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatch ", microbatch, " is backwarded twice"));
  }
  if (stashing_ && !stash_.count(saved.step)) {
    return absl::InternalError(absl::StrCat("stage ", stage_, ": the weight version ", saved.step,
                                            " of microbatch ", microbatch, " was not stashed"));
  }
  const Part part = split_ ? Part::kInput : Part::kWhole;
  torch::Tensor grad_input;
  double correction = 0;
  absl::Status st =
      saved.dropped ? Guard("dropped backward",
                            [&] {
                              if (!is_first()) grad_input = torch::zeros_like(saved.input);
                            })
      : virtual_.enabled
          ? Guard("virtual backward", [&] { grad_input = VirtualBackward(saved, part); })
          : Guard(absl::StrCat("stage ", stage_, " backward").c_str(), [&] {
              // Differentiate at the backward weights (T2's u_bkwd, or the
              // stashed version) by pointing each parameter at them: no copy of
              // w_t, one pass to form u_bkwd, none for a stash. The recompute
              // below builds its graph after the swap; a kept graph has its
              // forward's weights already.
              SwappedWeights swapped(module_->parameters());
              if (!saved.output.defined()) {
                const std::vector<torch::Tensor>* stashed = StashedWeights(saved);
                if (CorrectsDiscrepancy()) {
                  torch::NoGradGuard no_grad;
                  auto params = module_->parameters();
                  std::vector<torch::Tensor> u_bkwd;
                  for (size_t j = 0; j < params.size(); ++j) {
                    u_bkwd.push_back(T2BackwardWeights(params[j].data(), velocity_[j], tau_));
                  }
                  swapped.PointAt(u_bkwd);
                  correction = t2_correction_norm_;
                } else if (stashed != nullptr) {
                  swapped.PointAt(*stashed);
                }
                saved.x = saved.input.detach();
                if (!is_first()) saved.x.requires_grad_(true);
                saved.output = Recompute(saved.x, saved.rng, &saved.buffers);
                if (is_last()) {
                  saved.output = Loss(saved.output, saved.targets) /
                                 static_cast<double>(microbatches_per_step_);
                }
              }
              if (!is_last() && !grad_output.sizes().equals(saved.output.sizes())) {
                throw std::invalid_argument(absl::StrCat(
                    "gradient shape does not match the stage output of microbatch ", microbatch));
              }
              if (!is_last())
                saved.grad_output = grad_output.to(device_, saved.output.scalar_type());
              grad_input = Differentiate(saved, part);
            });
  if (!st.ok()) return st;  // saved_ keeps the microbatch: the stage fails anyway
  {
    absl::MutexLock lock(&stats_mu_);
    const int64_t version = saved.step;
    if (split_) {
      saved.input_gradient_done = true;
    } else {
      saved_.erase(it);
      if (stashing_ && --stash_[version].users == 0) stash_.erase(version);
    }
    stats_.last_backward_version = BackwardUsesForwardWeights(kind_) ? version : stats_.steps;
    UpdateMemoryLocked();
    stats_.last_delay = stats_.steps - version;
    delay_sum_ += static_cast<double>(stats_.last_delay);
    ++delay_count_;
    ++stats_.backwards;
    stats_.t2_correction_norm = correction;
    stats_.measured_delay = delay_sum_ / static_cast<double>(delay_count_);
  }
  if (!split_) ++backwards_since_step_;
  return grad_input;
}

absl::Status StageRuntime::WeightGradient(uint64_t microbatch) {
  auto it = saved_.find(microbatch);
  if (!split_ || it == saved_.end() || !it->second.input_gradient_done) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage ", stage_, ": a weight gradient (W) of microbatch ", microbatch,
        split_ ? " before its backward (B)" : " on a schedule that does not split backwards"));
  }
  Saved& saved = it->second;
  absl::Status st = absl::OkStatus();
  if (virtual_.enabled) {
    Busy(virtual_.weight_seconds_per_unit * units_);
  } else if (!saved.dropped) {
    st = Guard(absl::StrCat("stage ", stage_, " weight gradient").c_str(),
               [&] { Differentiate(saved, Part::kWeight); });
  }
  if (!st.ok()) return st;
  {
    absl::MutexLock lock(&stats_mu_);
    saved_.erase(it);
    UpdateMemoryLocked();
  }
  ++backwards_since_step_;
  return absl::OkStatus();
}

torch::Tensor StageRuntime::Differentiate(Saved& saved, Part part) {
  // The last stage's output is the loss: its gradient is implicit.
  std::vector<torch::Tensor> grad;
  if (!is_last()) grad.push_back(saved.grad_output);
  torch::Tensor grad_input;
  auto params = saved.copy ? saved.copy->parameters() : module_->parameters();
  auto live = module_->parameters();
  // A copy's gradients (or W's) go into the live parameters' gradients as
  // autograd would accumulate them there.
  auto accumulate = [&](const std::vector<torch::Tensor>& grads) {
    torch::NoGradGuard no_grad;
    for (size_t j = 0; j < live.size(); ++j) {
      if (!grads[j].defined()) continue;
      if (live[j].grad().defined()) {
        live[j].mutable_grad().add_(grads[j]);
      } else {
        live[j].mutable_grad() = grads[j].clone(at::MemoryFormat::Contiguous);
      }
    }
  };
  switch (part) {
    case Part::kWhole:
      saved.output.backward(grad.empty() ? torch::Tensor() : grad[0]);
      if (!is_first()) grad_input = saved.x.grad();
      if (saved.copy) {
        std::vector<torch::Tensor> grads;
        for (auto& p : params) {
          grads.push_back(p.grad());
          p.mutable_grad() = torch::Tensor();
        }
        accumulate(grads);
      }
      break;
    case Part::kInput:
      if (!is_first()) {
        grad_input = torch::autograd::grad({saved.output}, {saved.x}, grad,
                                           /*retain_graph=*/true)[0];
      }
      return grad_input;  // the graph stays for W
    case Part::kWeight:
      accumulate(torch::autograd::grad({saved.output}, params, grad, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true));
      break;
  }
  // A recompute's buffers go back once the graph is spent.
  if (!saved.buffers.empty()) {
    torch::NoGradGuard no_grad;
    auto buffers = module_->buffers();
    for (size_t j = 0; j < buffers.size(); ++j) buffers[j].copy_(saved.buffers[j]);
  }
  saved.output = torch::Tensor();
  saved.x = torch::Tensor();
  return grad_input;
}

absl::Status StageRuntime::Drop(uint64_t microbatch) {
  absl::MutexLock lock(&stats_mu_);
  auto it = saved_.find(microbatch);
  if (it == saved_.end()) {
    return absl::NotFoundError(absl::StrCat("microbatch ", microbatch, " is not saved"));
  }
  it->second.dropped = true;
  return absl::OkStatus();
}

torch::Tensor StageRuntime::Recompute(const torch::Tensor& x, const torch::Tensor& rng,
                                      std::vector<torch::Tensor>* buffers) {
  // The training forward already updated BatchNorm's running statistics and
  // drew dropout's masks: the recompute replays the forward's random numbers
  // and hands back the buffers as they were, to be put back after the
  // backward (autograd holds them until then), so it differs from the forward
  // only by the weights it runs at.
  {
    torch::NoGradGuard no_grad;
    for (const auto& b : module_->buffers()) buffers->push_back(b.clone());
  }
  torch::Tensor now;
  if (rng.defined()) {
    now = RngState();
    SetRngState(rng);
  }
  module_->train(true);
  torch::Tensor out = module_->forward(x);
  if (rng.defined()) SetRngState(now);
  return out;
}

absl::Status StageRuntime::Step() {
  if (backwards_since_step_ != microbatches_per_step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stage ", stage_, ": a step after ", backwards_since_step_, " backwards; each step takes ",
        microbatches_per_step_, " (schedule.microbatches_per_step)"));
  }
  backwards_since_step_ = 0;
  const auto start = std::chrono::steady_clock::now();
  const int64_t k = step_;
  const double alpha_k = BaseLearningRate(lr_schedule_, k);
  // T1 from the switch on; none during a synchronous warm-up (τ = 0 there).
  const bool warmup = k < warmup_steps_;
  const double lr =
      warmup ? alpha_k : T1LearningRate(alpha_k, k - warmup_steps_, lr_anneal_steps_, tau_);
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  // The virtual device has no gradients: its step is counted and T1's rate
  // computed, and nothing else.
  double grad_norm = 0;
  if (two_versions_ && !virtual_.enabled) {
    // W(k) stays for step k+1's microbatches, which run at it: as weights
    // to recompute at, or as the copy of the stage their graphs run on.
    torch::NoGradGuard no_grad;
    if (recompute_) {
      std::vector<torch::Tensor> weights;
      for (const auto& p : module_->parameters()) weights.push_back(p.detach().clone());
      absl::MutexLock lock(&stats_mu_);
      stash_[k] = Stash{std::move(weights), 0};
      stash_.erase(stash_.begin(), stash_.lower_bound(k));  // W(k-1): its step is done
    } else {
      std::shared_ptr<torch::nn::SequentialImpl> copy = copy_.lock();
      if (!copy || copy_version_ != k) copy = CopyOfStage();
      absl::MutexLock lock(&stats_mu_);
      two_bw_copy_ = copy;
      copy_ = copy;
      copy_version_ = k;
    }
  }
  if (virtual_.enabled && reduce_gradients_) {
    // The virtual device computes no gradients; its replicas still
    // all-reduce as many bytes as the stage's real ones would be.
    if (virtual_gradients_.empty()) {
      for (const auto& p : module_->parameters())
        virtual_gradients_.push_back(torch::zeros_like(p));
    }
    absl::Status st = Guard(absl::StrCat("stage ", stage_, " all-reduce").c_str(),
                            [&] { reduce_gradients_(virtual_gradients_); });
    if (!st.ok()) return st;
  }
  if (!virtual_.enabled) {
    // Spike compensation from the switch on, like T1 (no delay before it).
    absl::Status st = Guard(absl::StrCat("stage ", stage_, " optimizer step").c_str(), [&] {
      grad_norm = ApplyGradients(lr, spike_enabled_ && !warmup, dc_enabled_ && !warmup);
    });
    if (!st.ok()) return st;
  }
  absl::MutexLock lock(&stats_mu_);
  stats_.steps = ++step_;
  stats_.learning_rate = lr;
  stats_.last_grad_norm = grad_norm;
  if (warmup_steps_ > 0 && stats_.steps == warmup_steps_) {
    // The switch: every backward of the warm-up is done (each stage's plan
    // runs a synchronous step's N backwards before its update), so delays
    // from here on are τ_i's.
    stats_.async_from_step = stats_.steps;
    delay_sum_ = 0;
    delay_count_ = 0;
  }
  stats_.last_step_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  UpdateMemoryLocked();
  return absl::OkStatus();
}

void StageRuntime::CompensateDelay() {
  torch::NoGradGuard no_grad;
  auto params = module_->parameters();
  const auto& state = optimizer_->state();
  const bool sgd = dynamic_cast<torch::optim::SGD*>(optimizer_.get()) != nullptr;
  if (sgd && dc_mean_square_.empty()) dc_mean_square_.resize(params.size());
  for (size_t j = 0; j < params.size(); ++j) {
    torch::Tensor g = params[j].grad();
    if (!g.defined()) continue;
    torch::Tensor ms;  // the running mean square of g
    if (sgd) {
      // It starts at the first g², then ms ← β·ms + (1 − β)·g².
      torch::Tensor& own = dc_mean_square_[j];
      if (!own.defined()) own = g * g;
      const double beta = DcMeanSquareDecay();
      own.mul_(beta).addcmul_(g, g, 1 - beta);
      ms = own;
    } else {
      // Adam's v̂ before this step (g² before its first).
      auto it = state.find(OptimizerStateKey(state, params[j]));
      ms = g * g;
      if (it != state.end()) {
        if (auto adam = AdamStateOf(it->second.get(), optimizer_->param_groups()[0].options())) {
          ms = adam->exp_avg_sq / (1 - std::pow(adam->beta2, static_cast<double>(adam->step)));
        }
      }
    }
    g.copy_(DelayCompensatedGradient(g, static_cast<double>(tau_) * velocity_[j], ms, dc_lambda_));
  }
}

double StageRuntime::ApplyGradients(double lr, bool compensate, bool compensate_delay) {
  auto params = module_->parameters();
  if (reduce_gradients_) {
    // The replicas' average, before clipping and every correction.
    std::vector<torch::Tensor> grads;
    for (const auto& p : params) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    reduce_gradients_(grads);
  }
  double grad_norm = 0;
  if (grad_clip_norm_ > 0) grad_norm = torch::nn::utils::clip_grad_norm_(params, grad_clip_norm_);
  if (compensate_delay) CompensateDelay();
  std::vector<torch::Tensor> w_t;
  if (TracksVelocity()) {
    for (const auto& p : params) w_t.push_back(p.detach().clone());
  }
  // Spike compensation: g as the optimizer takes it (weight decay added),
  // before the step moves w.
  std::vector<torch::Tensor> g;
  const double weight_decay =
      compensate ? static_cast<torch::optim::SGDOptions&>(optimizer_->param_groups()[0].options())
                       .weight_decay()
                 : 0;
  if (compensate) {
    torch::NoGradGuard no_grad;
    for (const auto& p : params) {
      g.push_back(p.grad().defined() ? p.grad().detach() + weight_decay * p.detach()
                                     : torch::Tensor());
    }
  }
  optimizer_->step();
  optimizer_->zero_grad();
  if (compensate) {
    // The optimizer moved w by −α·v; the compensated update is
    // −α·(a·v + b·g): add −α·((a − 1)·v + b·g).
    torch::NoGradGuard no_grad;
    auto& state = optimizer_->state();
    for (size_t j = 0; j < params.size(); ++j) {
      if (!g[j].defined()) continue;
      auto it = state.find(OptimizerStateKey(state, params[j]));
      torch::Tensor v = g[j];  // momentum 0: no buffer, v = g
      if (it != state.end()) {
        const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get());
        if (sgd != nullptr && sgd->momentum_buffer().defined()) v = sgd->momentum_buffer();
      }
      torch::Tensor w = params[j].detach();
      w.sub_(SpikeCompensatedDirection(v, g[j], spike_) - v, lr);
    }
  }
  if (TracksVelocity()) {
    torch::NoGradGuard no_grad;
    double sq = 0;
    for (size_t j = 0; j < params.size(); ++j) {
      T2VelocityInPlace(velocity_[j], params[j].detach(), w_t[j], t2_gamma_);
      if (t2_enabled_) {
        const double norm = velocity_[j].norm().item<double>();
        sq += norm * norm;
      }
    }
    // ||u_bkwd - w_t|| = τ_i ||δ||, fixed until the next step: once per step,
    // not per backward.
    if (t2_enabled_) t2_correction_norm_ = tau_ * std::sqrt(sq);
  }
  return grad_norm;
}

torch::Tensor StageRuntime::VirtualBackward(const Saved& saved, Part part) {
  // A recompute runs the forward again first; B leaves W's share to W.
  const double seconds = (recompute_ ? virtual_.forward_seconds_per_unit : 0) +
                         virtual_.backward_seconds_per_unit -
                         (part == Part::kInput ? virtual_.weight_seconds_per_unit : 0);
  Busy(seconds * units_);
  if (is_first()) return torch::Tensor();
  auto zeros = virtual_zeros_.find(saved.input.sizes().vec());
  if (zeros == virtual_zeros_.end()) {
    zeros = virtual_zeros_.emplace(saved.input.sizes().vec(), torch::zeros_like(saved.input)).first;
  }
  return zeros->second;
}

StageSnapshot StageRuntime::Snapshot() const {
  torch::NoGradGuard no_grad;
  auto host = [](const torch::Tensor& t) {
    return t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
  };
  StageSnapshot snapshot;
  snapshot.stage = stage_;
  snapshot.step = Stats().steps;
  std::map<const void*, size_t> index;  // parameter -> position in velocity_
  const auto params = module_->parameters();
  for (size_t j = 0; j < params.size(); ++j) index[params[j].unsafeGetTensorImpl()] = j;
  const auto& state = optimizer_->state();
  int u = first_unit_;
  for (const auto& child : module_->children()) {
    UnitState unit;
    unit.unit = u++;
    for (const auto& p : child->named_parameters()) {
      const std::string& name = p.key();
      unit.tensors.emplace_back("param/" + name, host(p.value()));
      const size_t j = index.at(p.value().unsafeGetTensorImpl());
      if (TracksVelocity()) unit.tensors.emplace_back("t2/" + name, host(velocity_[j]));
      if (j < dc_mean_square_.size() && dc_mean_square_[j].defined()) {
        unit.tensors.emplace_back("dc/" + name, host(dc_mean_square_[j]));
      }
      auto it = state.find(OptimizerStateKey(state, p.value()));
      if (it == state.end()) continue;
      auto add = [&](const char* field, const torch::Tensor& t) {
        if (t.defined()) unit.tensors.emplace_back("optim/" + name + "/" + field, host(t));
      };
      const torch::optim::OptimizerParamState* s = it->second.get();
      if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
        add("momentum_buffer", sgd->momentum_buffer());
      } else if (auto adam = AdamStateOf(s, optimizer_->param_groups()[0].options())) {
        add("step", torch::tensor(adam->step, torch::kInt64));
        add("exp_avg", adam->exp_avg);
        add("exp_avg_sq", adam->exp_avg_sq);
        add("max_exp_avg_sq", adam->max_exp_avg_sq);
      }
    }
    for (const auto& b : child->named_buffers()) {
      unit.tensors.emplace_back("buffer/" + b.key(), host(b.value()));
    }
    snapshot.units.push_back(std::move(unit));
  }
  // The generator dropout draws from, in every unit: a stage restored from
  // any partition takes its first unit's (a few KB each).
  if (const torch::Tensor rng = RngState(); rng.defined()) {
    for (auto& unit : snapshot.units) unit.tensors.emplace_back(RngKey(device_), rng.clone());
  }
  return snapshot;
}

absl::Status StageRuntime::Restore(const std::vector<UnitState>& units, int64_t step,
                                   bool weights_only) {
  if (Stats().forwards > 0 || step_ > 0) {
    return absl::FailedPreconditionError("restore: the stage has already trained");
  }
  if (weights_only && step != 0) {
    return absl::InvalidArgumentError("restore: weights alone start at step 0");
  }
  std::map<int, const UnitState*> by_unit;
  for (const auto& u : units) by_unit[u.unit] = &u;
  std::map<const void*, size_t> index;  // parameter -> position in velocity_
  const auto params = module_->parameters();
  for (size_t j = 0; j < params.size(); ++j) index[params[j].unsafeGetTensorImpl()] = j;
  auto& state = optimizer_->state();
  torch::NoGradGuard no_grad;
  int u = first_unit_;
  for (const auto& child : module_->children()) {
    auto found = by_unit.find(u);
    if (found == by_unit.end()) {
      return absl::DataLossError(absl::StrCat("restore: the checkpoint has no unit ", u));
    }
    std::map<std::string, torch::Tensor> saved(found->second->tensors.begin(),
                                               found->second->tensors.end());
    auto take = [&](const std::string& key, const torch::Tensor& like) -> torch::Tensor {
      auto it = saved.find(key);
      if (it == saved.end()) return {};
      if (!it->second.sizes().equals(like.sizes())) {
        throw std::invalid_argument(absl::StrCat("unit ", u, " ", key, " is ",
                                                 c10::str(it->second.sizes()), ", the stage has ",
                                                 c10::str(like.sizes())));
      }
      return it->second.to(like.device(), like.scalar_type());
    };
    absl::Status st = Guard("restore", [&] {
      for (const auto& p : child->named_parameters()) {
        const std::string& name = p.key();
        torch::Tensor w = take("param/" + name, p.value());
        if (!w.defined()) throw std::invalid_argument(absl::StrCat("unit ", u, " has no ", name));
        p.value().copy_(w);
        if (weights_only) continue;
        const size_t j = index.at(p.value().unsafeGetTensorImpl());
        if (TracksVelocity()) {
          torch::Tensor v = take("t2/" + name, p.value());
          // A checkpoint taken without T2 (another schedule or τ): δ starts at 0.
          if (v.defined()) velocity_[j].copy_(v);
        }
        if (dc_enabled_ && dynamic_cast<torch::optim::SGD*>(optimizer_.get()) != nullptr) {
          // Absent: delay compensation was off, ms starts at the next g².
          torch::Tensor ms = take("dc/" + name, p.value());
          if (ms.defined()) {
            dc_mean_square_.resize(params.size());
            dc_mean_square_[j] = ms.clone();
          }
        }
        const std::string prefix = "optim/" + name + "/";
        if (dynamic_cast<torch::optim::SGD*>(optimizer_.get()) != nullptr) {
          // Saved only where momentum made one.
          torch::Tensor m = take(prefix + "momentum_buffer", p.value());
          if (m.defined()) {
            auto s = std::make_unique<torch::optim::SGDParamState>();
            s->momentum_buffer(m.clone());
            state[OptimizerStateKey(state, p.value())] = std::move(s);
          }
        } else {
          torch::Tensor m1 = take(prefix + "exp_avg", p.value());
          torch::Tensor m2 = take(prefix + "exp_avg_sq", p.value());
          auto k = saved.find(prefix + "step");
          if (!m1.defined() || !m2.defined() || k == saved.end()) continue;
          torch::Tensor mx = take(prefix + "max_exp_avg_sq", p.value());
          auto fill = [&](auto s) {
            s->step(k->second.item<int64_t>());
            s->exp_avg(m1.clone());
            s->exp_avg_sq(m2.clone());
            if (mx.defined()) s->max_exp_avg_sq(mx.clone());
            state[OptimizerStateKey(state, p.value())] = std::move(s);
          };
          if (dynamic_cast<torch::optim::AdamW*>(optimizer_.get())) {
            fill(std::make_unique<torch::optim::AdamWParamState>());
          } else {
            fill(std::make_unique<torch::optim::AdamParamState>());
          }
        }
      }
      for (const auto& b : child->named_buffers()) {
        torch::Tensor v = take("buffer/" + b.key(), b.value());
        if (!v.defined())
          throw std::invalid_argument(absl::StrCat("unit ", u, " has no ", b.key()));
        b.value().copy_(v);
      }
    });
    if (!st.ok()) return absl::DataLossError(st.message());
    ++u;
  }
  // Dropout's generator as it was at the cut (absent in older checkpoints:
  // the generator stays seeded as created).
  if (auto first = by_unit.find(first_unit_);
      first != by_unit.end() && !virtual_.enabled && !weights_only) {
    // A cut taken on another device type holds that type's generator
    // (CPU and CUDA states differ): this stage's generator then stays as
    // seeded.
    for (const auto& entry : first->second->tensors) {
      if (entry.first != RngKey(device_)) continue;
      const torch::Tensor& state = entry.second;
      absl::Status st = Guard("restore", [&] { SetRngState(state); });
      if (!st.ok()) {
        return absl::DataLossError(
            absl::StrCat("restore: unit ", first_unit_, " rng/state: ", st.message()));
      }
    }
  }
  if (t2_enabled_) {
    double sq = 0;
    for (const auto& v : velocity_) sq += v.pow(2).sum().item<double>();
    t2_correction_norm_ = tau_ * std::sqrt(sq);
  }
  absl::MutexLock lock(&stats_mu_);
  stats_.steps = step_ = step;
  train_forwards_ = step * microbatches_per_step_;
  first_version_ = step;  // a cut holds one version
  if (warmup_steps_ > 0 && step >= warmup_steps_) stats_.async_from_step = warmup_steps_;
  const double alpha = BaseLearningRate(lr_schedule_, step);
  stats_.learning_rate = step < warmup_steps_
                             ? alpha
                             : T1LearningRate(alpha, step - warmup_steps_, lr_anneal_steps_, tau_);
  UpdateMemoryLocked();
  return absl::OkStatus();
}

StageStats StageRuntime::Stats() const {
  absl::MutexLock lock(&stats_mu_);
  return stats_;
}

}  // namespace pipemare
