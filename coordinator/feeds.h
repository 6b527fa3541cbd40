// The coordinator's two feeds of a run: inputs to stage 0 and targets to the
// last stage, each a Pipe stream (common/pipe_stream.h). What the stages send
// back on them (stage 0's backward done, the last stage's results, a stage's
// error) becomes FeedEvents, queued from gRPC's threads for the runner.
#ifndef PIPEMARE_COORDINATOR_FEEDS_H_
#define PIPEMARE_COORDINATOR_FEEDS_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/pipe_stream.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// What a feed hands to the runner.
struct FeedEvent {
  enum Kind { kDone, kResult, kError } kind = kError;
  uint64_t microbatch = 0;
  int replica = 0;  // the pipeline it came from (schedule.replicas)
  v1::Phase phase = v1::TRAIN;
  v1::MicrobatchResult result;
  bool skipped = false;  // a result of a microbatch dropped for a NaN or Inf
  std::string error;
  // kError: the stage's StageError.code; UNAVAILABLE (or 0) is what
  // recovery may retry.
  absl::StatusCode code = absl::StatusCode::kUnavailable;
};

class Feeds {
 public:
  // The feeds of generation `generation` of job `job_id`; each queues at most
  // `window` messages (the pipeline's in-flight window).
  Feeds(std::string job_id, int64_t generation, size_t window);
  // Close().
  ~Feeds();
  Feeds(const Feeds&) = delete;
  Feeds& operator=(const Feeds&) = delete;

  // The two ends of one pipeline (replica): stage 0 and the last stage, and
  // their labels for errors ("stage 0 (worker w-1 at host:port)").
  struct Ends {
    std::shared_ptr<grpc::Channel> first, last;
    std::string first_label, last_label;
  };
  // Opens each replica's target feed to its last stage, then its input
  // feed to its stage 0 (the stages must be loaded).
  void Open(const std::vector<Ends>& replicas);
  // Sends `slice` as microbatch `id` to both feeds: stage 0 reads its
  // inputs, the last stage its targets, each from its own copy of the data
  // (StageAssignment.data); targets first, so the last stage has them when
  // the activation arrives. Blocks while a feed's window is full.
  // UNAVAILABLE once a feed is lost.
  absl::Status Send(int replica, const v1::DataSlice& slice, uint64_t id, v1::Phase phase);
  // Bytes every Feeds of this process has sent (the coordinator's data path,
  // pipemare_coordinator_sent_bytes_total).
  static uint64_t TotalSentBytes();
  // The next event, waiting up to `wait`; nothing if none came (or Wake).
  std::optional<FeedEvent> Next(std::chrono::milliseconds wait);
  // Ends a Next that waits.
  void Wake();
  // Cancels both feeds; after it no event arrives. Idempotent.
  void Close();

 private:
  struct Feed {
    std::shared_ptr<PipeStream> stream;
    std::string what;  // "input feed to stage 0 (worker ...)"
  };
  void OpenFeed(Feed& feed, int replica, std::shared_ptr<grpc::Channel> channel,
                const std::string& label, v1::StreamOpen::Role role);
  // A feed's reaction to what a stage sent (never blocks).
  void OnMessage(int replica, const std::string& what, absl::StatusOr<PipeMessage> m);
  void Push(FeedEvent e);

  const std::string job_id_;
  const int64_t generation_;
  const size_t window_;
  struct Pair {
    Feed input, target;
  };
  std::vector<Pair> feeds_;  // one per replica
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<FeedEvent> events_;  // under mu_
  bool woken_ = false;            // under mu_
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_FEEDS_H_
