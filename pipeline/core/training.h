// Training policy, defined once for the coordinator's job runner and for
// in-process runs of a job (bench/harness_run.cc): the order of the training
// split each epoch, how many microbatches are kept in flight, and the size of
// an evaluation microbatch. No LibTorch.
#ifndef PIPEMARE_PIPELINE_TRAINING_H_
#define PIPEMARE_PIPELINE_TRAINING_H_

#include <cstdint>
#include <vector>

#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// Example indices of the training split in the order epoch `epoch` (1-based)
// feeds them: 0..count-1, shuffled by train.seed and the epoch unless
// train.shuffle is false.
std::vector<int64_t> EpochOrder(int64_t count, const v1::TrainSpec& train, int epoch);

// TRAIN microbatches the coordinator keeps in flight. Asynchronous 1F1B:
// P, plus one prefetched so that stage 0 never waits a round trip for its
// next input. Synchronous steps (gpipe, a warm-up): one step of N plus the
// next step's N (each stage's plan runs a step's forwards only after the
// previous step's update, so no flush is needed).
inline int64_t InFlightWindow(bool synchronous, int stages, int microbatches_per_step) {
  return synchronous ? 2 * static_cast<int64_t>(microbatches_per_step) : stages + 1;
}

// Examples per evaluation microbatch: at least 256 (evaluation keeps no
// activations, so larger microbatches only make it faster).
inline int64_t EvalMicrobatchSize(int64_t microbatch_size) {
  return microbatch_size > 256 ? microbatch_size : 256;
}

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_TRAINING_H_
