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
#include "pipeline/core/data.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

// What a feed hands to the runner.
struct FeedEvent {
  enum Kind { kDone, kResult, kError } kind = kError;
  uint64_t microbatch = 0;
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

  // Opens the target feed to the last stage, then the input feed to stage 0
  // (the stages must be loaded). `first_label`, `last_label` name the stages
  // in errors: "stage 0 (worker w-1 at host:port)".
  void Open(std::shared_ptr<grpc::Channel> first, std::string first_label,
            std::shared_ptr<grpc::Channel> last, std::string last_label);
  // Sends examples [begin, begin + count) of `data` (by `order` when not
  // empty) as microbatch `id`: targets first, so the last stage has them
  // when the activation arrives. Blocks while a feed's window is full.
  // UNAVAILABLE once a feed is lost.
  absl::Status Send(const Examples& data, const std::vector<int64_t>& order, int64_t begin,
                    int64_t count, uint64_t id, v1::Phase phase);
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
  void OpenFeed(Feed& feed, std::shared_ptr<grpc::Channel> channel, const std::string& label,
                v1::StreamOpen::Role role);
  // A feed's reaction to what a stage sent (never blocks).
  void OnMessage(const std::string& what, absl::StatusOr<PipeMessage> m);
  void Push(FeedEvent e);

  const std::string job_id_;
  const int64_t generation_;
  const size_t window_;
  Feed input_, target_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<FeedEvent> events_;  // under mu_
  bool woken_ = false;            // under mu_
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_FEEDS_H_
