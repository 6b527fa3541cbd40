#include "common/buffer_pool.h"

#include <cstdlib>
#include <new>

namespace pipemare {

BufferPool& BufferPool::Receive() {
  static BufferPool* pool = new BufferPool;  // leaked on purpose: see the header
  return *pool;
}

std::shared_ptr<uint8_t> BufferPool::Take(size_t bytes) {
  if (bytes == 0) bytes = 1;
  uint8_t* data = nullptr;
  bool pooled = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pooled = enabled_ && bytes >= kMinBytes;
    if (pooled) {
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].bytes != bytes) continue;
        data = free_[i].data;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        free_bytes_ -= bytes;
        ++reused_;
        break;
      }
      if (data == nullptr) ++allocated_;
    }
  }
  if (data == nullptr) {
    // aligned_alloc wants a multiple of the alignment.
    const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    data = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, rounded));
    if (data == nullptr) return nullptr;
  }
  if (!pooled) return std::shared_ptr<uint8_t>(data, [](uint8_t* p) { std::free(p); });
  return std::shared_ptr<uint8_t>(data, [this, bytes](uint8_t* p) { Give(p, bytes); });
}

void BufferPool::Give(uint8_t* data, size_t bytes) {
  std::vector<uint8_t*> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (enabled_ && bytes <= kMaxFreeBytes) {
      free_.push_back({bytes, data});
      free_bytes_ += bytes;
      data = nullptr;
      // Over a limit: the oldest free buffers go first.
      while (free_.size() > kMaxFreeBuffers || free_bytes_ > kMaxFreeBytes) {
        release.push_back(free_.front().data);
        free_bytes_ -= free_.front().bytes;
        free_.erase(free_.begin());
      }
    }
  }
  if (data != nullptr) std::free(data);
  for (uint8_t* p : release) std::free(p);
}

void BufferPool::SetEnabled(bool enabled) {
  std::vector<Free> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    enabled_ = enabled;
    if (!enabled) {
      release.swap(free_);
      free_bytes_ = 0;
    }
  }
  for (const Free& f : release) std::free(f.data);
}

BufferPool::Stats BufferPool::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Stats{reused_, allocated_, free_.size(), free_bytes_};
}

}  // namespace pipemare
