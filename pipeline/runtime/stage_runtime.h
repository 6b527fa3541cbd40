// The stage runtime: one stage's units, optimizer and update rule. It does no
// I/O: the stage host (stage_worker/) receives tensors, calls Forward /
// ForwardLoss / Backward in the order its schedule dictates, and sends what
// they return.
//
// Update rules by schedule (see docs/algorithm.md):
//   gpipe, 1f1b, zero_bubble: backward at the current weights (== forward
//              weights: τ = 0); zero_bubble splits it into B (Backward: the
//              input gradient) and W (WeightGradient).
//   pipedream: backward at the weights its forward used, stashed at forward
//              time (one copy per weight version still in flight).
//   pipedream_2bw: every microbatch of step t runs forward and backward at
//              W(t-1) (W(t) during a warm-up), the one stashed version
//              besides the live W(t); the step applies its gradient to W(t).
//   async:     backward at the current weights w_t (the naive baseline).
//   pipemare:  backward at T2's u_bkwd = w_t - τ_i δ_t (at w_t when T2 is
//              off); step size by T1.
// All: one optimizer step every N backwards; pipemare, pipedream and async
// have the analytic delay τ_i = ceil((P-1-i)/N), pipedream_2bw 1. With a
// synchronous warm-up (T3) they run as gpipe until `warmup_steps` steps are
// applied: backward at w_t, no T1; T2's velocity is kept up to date so it is
// warm at the switch. T1's annealing then counts from the switch.
// schedule.recompute: a backward recomputes the stage forward from the saved
// stage input at the backward weights, so autograd never holds a graph
// across an update; without it (the schedules whose backward runs at the
// forward's weights) the training forward keeps its graph, and the backward
// differentiates that: a stashed version's forward runs on a copy of the
// stage holding that version, so no update touches what the graph saved.
//
// Thread-compatible: one thread (the stage host's compute thread) calls the
// mutators; Stats() may be called from any thread.
#ifndef PIPEMARE_PIPELINE_STAGE_RUNTIME_H_
#define PIPEMARE_PIPELINE_STAGE_RUNTIME_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "pipeline/core/lr_schedule.h"
#include "pipeline/core/pipemare_math.h"
#include "pipeline/core/schedule.h"
#include "pipeline/model/checkpoint_units.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// Bytes a stage holds now, from the tensors themselves.
struct StageMemory {
  int64_t weights = 0;
  int64_t optimizer_state = 0;    // SGD momentum buffers, Adam's two moments
  int64_t t2_velocity = 0;        // T2's δ
  int64_t stash = 0;              // stashed weight versions (pipedream)
  int64_t saved_activations = 0;  // stage inputs (and targets) kept for backwards
};

struct StageStats {
  int64_t steps = 0;
  int64_t forwards = 0;
  int64_t backwards = 0;
  // Mean optimizer steps between forward and backward, over the backwards
  // since the switch to asynchronous execution (all, without a warm-up).
  double measured_delay = 0;
  int64_t last_delay = 0;        // steps between the last backward's microbatch's forward and it
  int64_t async_from_step = -1;  // step of the switch after a warm-up; -1: none yet
  double learning_rate = 0;      // at the last step, after T1
  int64_t parameters = 0;
  int analytic_delay = 0;         // τ_i
  int64_t in_flight = 0;          // forwards whose backward has not run
  double t2_correction_norm = 0;  // ||u_bkwd - w_t||_2 at the last backward
  double last_step_seconds = 0;   // duration of the last optimizer step
  // Weight version (optimizer steps applied) the last backward differentiated
  // at: its forward's version under gpipe and pipedream, the current one
  // under async and pipemare (T2 extrapolates from it); -1 before any.
  int64_t last_backward_version = -1;
  int64_t stashed_versions = 0;  // weight versions held in the stash (or stage copies)
  double last_grad_norm = 0;     // before clipping, at the last step; 0 without clipping
  StageMemory memory;
  StageMemory peak_memory;  // the most of each kind held at any time
};

// The virtual device, for measuring pipelines larger than this machine: each
// unit's forward and backward compute become a wait of a fixed duration (a
// sleep, as if an accelerator were busy, so the CPU stays free). Everything
// else is real: every message and its tensor shapes and bytes, the plan, the
// step counts, the measured delays and T1's learning rates. The values are
// not: outputs and gradients are zeros and the weights never change. For
// speed benchmarks only (pipemare-worker --virtual-device).
// A backward that recomputes also waits the forward's time; zero_bubble's
// B waits the backward's less its W share, and W that share.
struct VirtualDevice {
  bool enabled = false;
  double forward_seconds_per_unit = 0;
  double backward_seconds_per_unit = 0;  // the whole backward, B and W
  double weight_seconds_per_unit = 0;    // W's share of it
};

// "FWD_MS,BWD_MS[,W_MS]" (milliseconds per unit, >= 0) -> an enabled
// VirtualDevice: BWD_MS the input gradient and W_MS the weight gradient
// (the whole backward BWD_MS + W_MS); without W_MS, BWD_MS is the whole
// backward and W half of it. INVALID_ARGUMENT naming `flag` otherwise.
absl::StatusOr<VirtualDevice> ParseVirtualDevice(const std::string& text, const std::string& flag);

struct LossResult {
  double loss = 0;  // mean cross-entropy over the microbatch's predictions
  int64_t correct = 0;
  int64_t count = 0;        // examples
  int64_t predictions = 0;  // examples, or tokens for a language model
};

// The key of dropout's generator state in a cut's unit files: per device
// type ("rng/state" on CPU, "rng/cuda_state" on CUDA), since a CUDA
// generator's state does not load into a CPU one or the other way round.
std::string RngKey(const torch::Device& device);

class StageRuntime {
 public:
  // Validates the assignment (unit range, schedule, optimizer) and builds the
  // stage. Errors name the assignment field.
  // The stage's weights, optimizer state and saved inputs live on `device`.
  // Weights are float32 unless `dtype` says otherwise (the exactness tests
  // run in float64).
  static absl::StatusOr<std::unique_ptr<StageRuntime>> Create(const v1::StageAssignment& a,
                                                              torch::Device device = torch::kCPU,
                                                              torch::Dtype dtype = torch::kFloat32,
                                                              VirtualDevice virtual_device = {});

  StageRuntime(const StageRuntime&) = delete;
  StageRuntime& operator=(const StageRuntime&) = delete;

  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ == num_stages_ - 1; }
  ScheduleKind schedule() const { return kind_; }
  int microbatches_per_step() const { return microbatches_per_step_; }

  torch::Device device() const { return device_; }

  // Forward of `microbatch` at the current weights (inputs are moved to the
  // stage's device). With `train`, saves the
  // input for the backward. Returns the stage output. Errors: the input's
  // shape does not fit the first unit, or a duplicate microbatch id.
  absl::StatusOr<torch::Tensor> Forward(uint64_t microbatch, const torch::Tensor& input,
                                        bool train);

  // Last stage only: forward plus cross-entropy against `targets` (INT64
  // class ids: [B] for classification, [B, T] next tokens for a language
  // model whose output is [B, T, vocab]). With `train`, saves input and targets; the backward
  // follows with Backward(microbatch, {}).
  absl::StatusOr<LossResult> ForwardLoss(uint64_t microbatch, const torch::Tensor& input,
                                         const torch::Tensor& targets, bool train);

  // Backward of a saved microbatch. `grad_output` is dL/d(stage output), or
  // undefined on the last stage (the saved loss is differentiated). Returns
  // dL/d(stage input), undefined on the first stage. Accumulates the
  // gradient; it never steps by itself (the plan's U does: Step).
  // zero_bubble: only the input gradient (B); WeightGradient follows.
  absl::StatusOr<torch::Tensor> Backward(uint64_t microbatch, const torch::Tensor& grad_output);

  // zero_bubble's W: the weight gradient of a microbatch whose Backward ran,
  // accumulated; frees what the microbatch held. FAILED_PRECONDITION on
  // another schedule or before its Backward.
  absl::Status WeightGradient(uint64_t microbatch);

  // Drops saved microbatch `microbatch` from learning (train.on_nonfinite:
  // skip): its Backward then differentiates nothing, accumulates no
  // gradient, and returns zeros for the stage below; it still counts as one
  // of the step's N backwards, so the plan is unchanged. NOT_FOUND if it is
  // not saved.
  absl::Status Drop(uint64_t microbatch);

  // One optimizer step (a plan's U) from the N accumulated backwards: T1's
  // learning rate, clipping, the optimizer, T2's velocity. FAILED_PRECONDITION
  // unless exactly N backwards ran since the last step.
  absl::Status Step();
  int backwards_since_step() const { return backwards_since_step_; }

  StageStats Stats() const;

  // The stage's state now, copied to host memory unit by unit: weights and
  // buffers, optimizer state, T2's δ, and the step count (T1's position).
  // The stage executor takes it right after the cut's step.
  StageSnapshot Snapshot() const;

  // Puts back the state of a cut after step `step`: every unit of this stage
  // from `units` (any partition's files: matched by unit index, then by
  // name), its weights, buffers, optimizer state and T2's δ, and the step
  // count (the learning-rate schedule, T1 and T3 continue from it). Call
  // before the first forward. DATA_LOSS naming the unit and tensor when one is
  // missing or of another shape.
  // `weights_only` (submit --init-from): weights and buffers alone, at step
  // 0; optimizer state, T2's δ and the generator start fresh.
  absl::Status Restore(const std::vector<UnitState>& units, int64_t step,
                       bool weights_only = false);

  // schedule.replicas: called with the stage's gradients (those defined)
  // at every optimizer step, before anything else touches them, to average
  // them in place with the other replicas' (the worker's ReplicaGroup). Set
  // before the first action.
  using GradientReducer = std::function<void(const std::vector<torch::Tensor>&)>;
  void SetGradientReducer(GradientReducer reduce) { reduce_gradients_ = std::move(reduce); }

  // The stage's parameters (for tests).
  std::vector<torch::Tensor> Parameters() const { return module_->parameters(); }
  std::vector<torch::Tensor> Buffers() const { return module_->buffers(); }

 private:
  StageRuntime(const v1::StageAssignment& a, ScheduleKind kind, torch::nn::Sequential module,
               std::function<torch::nn::Sequential()> build, torch::Device device,
               VirtualDevice virtual_device);
  // A copy of the stage with the live parameters' current data and buffers.
  std::shared_ptr<torch::nn::SequentialImpl> CopyOfStage();

  struct Saved {
    torch::Tensor input;
    torch::Tensor targets;  // last stage only
    // The weight version the forward ran at (optimizer steps applied then;
    // pipedream_2bw: the version it picked).
    int64_t step = 0;
    torch::Tensor rng;     // the generator's state before the forward (dropout's masks)
    bool dropped = false;  // Drop(): the backward only passes zeros on
    // The graph (schedule.recompute false; zero_bubble from B to W): the
    // stage input it starts at (requires grad but on the first stage), its
    // output (the last stage: the loss over N), the copy of the stage it ran
    // on when not the live one, and, from B on, the gradient it got.
    torch::Tensor x;
    torch::Tensor output;
    std::shared_ptr<torch::nn::SequentialImpl> copy;
    torch::Tensor grad_output;
    std::vector<torch::Tensor> buffers;  // a recompute's, put back after W
    bool input_gradient_done = false;    // zero_bubble: B ran, W to come
  };

  // A stashed weight version (pipedream) and the in-flight microbatches
  // whose backward still needs it.
  struct Stash {
    std::vector<torch::Tensor> weights;
    int users = 0;
  };

  // Saves what the backward of a training forward needs: the stage input,
  // the targets (last stage) and, under pipedream, the weight version.
  // `saved` has the input, targets, version (step), rng and any graph.
  void Remember(uint64_t microbatch, Saved saved);
  // The forward (training or evaluation mode). With `graph`, it keeps the
  // graph there (x, output, copy) for the backward: on a copy of the stage
  // at version `version` where that is not the live weights or an update
  // comes before the backward.
  absl::StatusOr<torch::Tensor> Run(const torch::Tensor& input, bool train, Saved* graph = nullptr,
                                    int64_t version = 0);
  // pipedream_2bw: the version the next training forward runs at.
  int64_t TwoBwVersion() const;
  // The weights of version `version` when not the live ones: pipedream's or
  // pipedream_2bw's stash; null for the live weights.
  const std::vector<torch::Tensor>* VersionWeights(int64_t version) const;
  // Differentiates `saved`'s graph: the whole backward, or (`part`) only the
  // input gradient (B) or only the weight gradient (W, into the live
  // parameters' gradients). Returns the input gradient for B and whole.
  enum class Part { kWhole, kInput, kWeight };
  torch::Tensor Differentiate(Saved& saved, Part part);
  // The backward's forward at the current (swapped-in) weights, with graph,
  // dropout's masks replayed from `rng`. `buffers` receives copies of the
  // module's buffers from before it (BatchNorm's running statistics), for the
  // caller to put back once the backward is done.
  torch::Tensor Recompute(const torch::Tensor& x, const torch::Tensor& rng,
                          std::vector<torch::Tensor>* buffers);
  torch::Tensor RngState() const;
  void SetRngState(const torch::Tensor& state);
  // The weights the backward of `saved` differentiates at, when not the
  // current w_t: the stashed version (pipedream; null when none is needed),
  // or T2's u_bkwd = w_t - τ_i δ (pipemare after any warm-up).
  const std::vector<torch::Tensor>* StashedWeights(const Saved& saved) const;
  bool CorrectsDiscrepancy() const;
  // Step's update of the weights from the accumulated gradients: clipping,
  // the optimizer at rate `lr` (spike compensation after it, when
  // `compensate`), T2's velocity. Returns the gradient norm before clipping
  // (0 without clipping).
  double ApplyGradients(double lr, bool compensate, bool compensate_delay);
  // The virtual device's backward: the wait, and a shared zero input
  // gradient (undefined on the first stage).
  torch::Tensor VirtualBackward(const Saved& saved, Part part);

  const int stage_;
  const int num_stages_;
  const ScheduleKind kind_;
  const int microbatches_per_step_;
  const int tau_;                                 // τ_i, analytic
  const LrSchedule lr_schedule_;                  // α_k
  const double grad_clip_norm_;                   // 0 = off
  GradientReducer reduce_gradients_;              // schedule.replicas > 1
  std::vector<torch::Tensor> virtual_gradients_;  // the virtual device's stand-ins for them
  const int64_t lr_anneal_steps_;                 // T1's K; 0 = off
  const int64_t warmup_steps_;                    // T3's W; 0 = off
  const bool t2_enabled_;
  const double t2_gamma_;
  // schedule.spike_compensation on a stage with τ_i > 0 (sgd), and its a, b.
  const bool spike_enabled_;
  const SpikeCoefficients spike_;
  // schedule.weight_prediction on a stage with τ_i > 0.
  const bool predict_enabled_;
  // schedule.delay_compensation (DC-ASGD's λ0) on a stage with τ_i > 0.
  const bool dc_enabled_;
  const double dc_lambda_;
  // δ is kept for T2 and for delay compensation (its displacement τ_i·δ).
  bool TracksVelocity() const { return t2_enabled_ || dc_enabled_; }
  // Linear weight prediction: ŵ = w − τ_i·α·d for each parameter, d the
  // optimizer's current direction, α the last step's rate; empty while no
  // step has made a direction (or during a T3 warm-up).
  std::vector<torch::Tensor> PredictWeights();
  // pipedream with τ_i > 0 (the last stage's backward follows its forward
  // before any update, so it needs no stash).
  const bool stashing_;
  const bool two_versions_;  // pipedream_2bw
  const bool recompute_;     // schedule.recompute
  const bool split_;         // zero_bubble: B and W
  // pipedream_2bw: training forwards run (a step's N share a version), and
  // the oldest version there is (a restored cut holds only its own).
  int64_t train_forwards_ = 0;
  int64_t first_version_ = 0;
  // The newest copy of the stage a kept graph runs on (alive while a saved
  // microbatch holds it), and its version.
  std::weak_ptr<torch::nn::SequentialImpl> copy_;
  int64_t copy_version_ = -1;
  // pipedream_2bw keeping graphs: the copy at W(k) from step k on, for step
  // k+1's forwards (what the stash holds when recomputing).
  std::shared_ptr<torch::nn::SequentialImpl> two_bw_copy_;
  const torch::Device device_;
  const int first_unit_;
  const int units_;
  const VirtualDevice virtual_;
  // Virtual device: the (zero) output by input shape, its shape from one real
  // forward each; and the (zero) input gradient by input shape. Shared and
  // never written, so a virtual microbatch allocates nothing.
  std::map<std::vector<int64_t>, torch::Tensor> virtual_out_;
  std::map<std::vector<int64_t>, torch::Tensor> virtual_zeros_;
  torch::nn::Sequential module_;
  const std::function<torch::nn::Sequential()> build_;  // the stage's units, afresh
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<torch::Tensor> velocity_;  // T2's δ, one per parameter
  // Delay compensation with sgd: the running mean square of g, one per
  // parameter (empty until its first compensated step; adam uses its v̂).
  std::vector<torch::Tensor> dc_mean_square_;
  // g ← DelayCompensatedGradient(g, τ_i·δ, ms, λ0) for every gradient.
  void CompensateDelay();
  double t2_correction_norm_ = 0;  // τ_i ||δ||, updated at each step
  std::map<uint64_t, Saved> saved_;
  std::map<int64_t, Stash> stash_;  // by weight version; pipedream only
  int backwards_since_step_ = 0;

  // Recomputes stats_.memory.
  void UpdateMemoryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stats_mu_);

  // The weight version (steps taken): only the compute thread changes and
  // reads it; stats_.steps publishes it to the other threads.
  int64_t step_ = 0;
  mutable absl::Mutex stats_mu_;
  StageStats stats_ ABSL_GUARDED_BY(stats_mu_);
  double delay_sum_ ABSL_GUARDED_BY(stats_mu_) = 0;  // over the backwards of the current phase
  int64_t delay_count_ ABSL_GUARDED_BY(stats_mu_) = 0;
};

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_STAGE_RUNTIME_H_
