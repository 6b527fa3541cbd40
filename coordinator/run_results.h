// The numbers of a run from what the last stage reports, without I/O:
// training loss over the publish window and the epoch, examples trained,
// and the evaluation's loss and accuracy. A microbatch dropped for a NaN or
// Inf (train.on_nonfinite: skip) is counted by the stage that dropped it and
// in none of these.
#ifndef PIPEMARE_COORDINATOR_RUN_RESULTS_H_
#define PIPEMARE_COORDINATOR_RUN_RESULTS_H_

#include <cmath>
#include <cstdint>

#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class RunResults {
 public:
  void StartEpoch() {
    epoch_loss_ = 0;
    epoch_count_ = 0;
  }
  void StartEvaluation() {
    eval_loss_ = 0;
    eval_correct_ = eval_count_ = eval_predictions_ = 0;
  }
  void AddTraining(const v1::MicrobatchResult& r) {
    window_loss_ += r.loss();
    ++window_count_;
    epoch_loss_ += r.loss();
    ++epoch_count_;
    samples_trained_ += r.count();
  }
  void AddEvaluation(const v1::MicrobatchResult& r) {
    // Losses are means over predictions (examples, or tokens).
    const int64_t predictions = r.predictions() > 0 ? r.predictions() : r.count();
    eval_loss_ += r.loss() * predictions;
    eval_correct_ += r.correct();
    eval_count_ += r.count();
    eval_predictions_ += predictions;
  }

  // The mean training loss of the results since the last call; the last
  // one when none came since (NaN before any).
  double TakeWindowLoss() {
    if (window_count_ > 0) {
      last_train_loss_ = window_loss_ / static_cast<double>(window_count_);
      window_loss_ = 0;
      window_count_ = 0;
    }
    return last_train_loss_;
  }
  double epoch_train_loss() const {
    return epoch_count_ ? epoch_loss_ / static_cast<double>(epoch_count_) : 0;
  }
  int64_t samples_trained() const { return samples_trained_; }

  struct Evaluation {
    double accuracy = 0;  // over predictions: examples, or next tokens
    double loss = 0;
    double perplexity = 0;  // a language model's
  };
  Evaluation Evaluated(bool language_model) const {
    Evaluation e;
    if (eval_predictions_ > 0) {
      e.accuracy = static_cast<double>(eval_correct_) / static_cast<double>(eval_predictions_);
      e.loss = eval_loss_ / static_cast<double>(eval_predictions_);
    }
    if (language_model) e.perplexity = std::exp(e.loss);
    return e;
  }

 private:
  double window_loss_ = 0;
  int64_t window_count_ = 0;
  double last_train_loss_ = NAN;
  double epoch_loss_ = 0;
  int64_t epoch_count_ = 0;
  int64_t samples_trained_ = 0;
  double eval_loss_ = 0;
  int64_t eval_correct_ = 0, eval_count_ = 0, eval_predictions_ = 0;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_RUN_RESULTS_H_
