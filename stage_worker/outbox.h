// Outbox: one sending thread per pipeline edge, so that a stage computes
// microbatch m while m-1's output is still being written. The queue is
// bounded (the edge's in-flight window): a full outbox blocks the producer,
// which is the backpressure that keeps a fast stage from piling messages up
// in front of a slow neighbour. gRPC's HTTP/2 flow control then bounds what is
// in transit, so a stage's memory does not grow with the length of a run.
#ifndef PIPEMARE_STAGE_WORKER_OUTBOX_H_
#define PIPEMARE_STAGE_WORKER_OUTBOX_H_

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class Outbox {
 public:
  // `write` sends one message and returns false when the stream broke; the
  // outbox then calls `broken` once and drops what is left.
  Outbox(size_t capacity, std::function<bool(const v1::StageMessage&)> write,
         std::function<void()> broken);
  ~Outbox();  // Close() and join
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  // Queues `message`, waiting while the outbox holds `capacity` messages.
  // False when the outbox is closed or its stream broke.
  bool Push(v1::StageMessage message);
  // Stops accepting messages and wakes every waiter; the thread exits after
  // the message it is writing. Does not join.
  void Close();
  // The most messages ever queued at once.
  size_t high_water() const;
  // Seconds producers spent waiting for room (backpressure).
  double blocked_seconds() const;

 private:
  void Run();

  const size_t capacity_;
  const std::function<bool(const v1::StageMessage&)> write_;
  const std::function<void()> broken_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::StageMessage> queue_;  // GUARDED_BY(mu_)
  bool closed_ = false;                 // GUARDED_BY(mu_)
  size_t high_water_ = 0;               // GUARDED_BY(mu_)
  double blocked_seconds_ = 0;          // GUARDED_BY(mu_)
  std::thread thread_;
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_OUTBOX_H_
