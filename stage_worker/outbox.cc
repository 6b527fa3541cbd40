#include "stage_worker/outbox.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace pipemare {

Outbox::Outbox(size_t capacity, std::function<bool(const v1::StageMessage&)> write,
               std::function<void()> broken)
    : capacity_(std::max<size_t>(capacity, 1)),
      write_(std::move(write)),
      broken_(std::move(broken)),
      thread_([this] { Run(); }) {}

Outbox::~Outbox() {
  Close();
  if (thread_.joinable()) thread_.join();
}

bool Outbox::Push(v1::StageMessage message) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!closed_ && queue_.size() >= capacity_) {
    const auto start = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return closed_ || queue_.size() < capacity_; });
    blocked_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (closed_) return false;
  queue_.push_back(std::move(message));
  high_water_ = std::max(high_water_, queue_.size());
  cv_.notify_all();
  return true;
}

void Outbox::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
}

size_t Outbox::high_water() const {
  std::lock_guard<std::mutex> lock(mu_);
  return high_water_;
}

double Outbox::blocked_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocked_seconds_;
}

void Outbox::Run() {
  while (true) {
    v1::StageMessage message;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (closed_) return;
      message = std::move(queue_.front());
      queue_.pop_front();
      cv_.notify_all();  // room for a waiting producer
    }
    if (!write_(message)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
        queue_.clear();
        cv_.notify_all();
      }
      broken_();
      return;
    }
  }
}

}  // namespace pipemare
