// Receive buffers for large payloads, recycled instead of mapped afresh.
//
// A received activation or gradient is copied out of gRPC's slices into one
// contiguous buffer (or received there directly by the gloo data plane).
// glibc serves an allocation above its mmap threshold (32 MiB at most, see
// TuneMallocForLargeMessages) with a fresh mmap, and every page of it then
// faults in on the copy: at 64 MiB that made a hop cost ~200 ms on the 2-core
// VM (docs/benchmarks.md, "Transport"). Payloads of one stage repeat their
// sizes step after step, so a buffer freed by the compute thread is handed to
// the next receive of the same size, its pages already mapped.
//
// Below 32 MiB glibc serves these from its heap, yet a fresh buffer still
// cost 4–16 MiB payloads 2–38% of their throughput (memory a threaded
// arena gave back, or heap not yet touched, faults in again), so the pool
// starts at 1 MiB (docs/benchmarks.md, "The receive pool from 1 MiB").
// Below kMinBytes, Take allocates plainly.
// At most kMaxFreeBuffers buffers and kMaxFreeBytes bytes wait free; a buffer
// returned beyond that is released. Thread-safe.
#ifndef PIPEMARE_COMMON_BUFFER_POOL_H_
#define PIPEMARE_COMMON_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace pipemare {

class BufferPool {
 public:
  static constexpr size_t kMinBytes = size_t{1} << 20;
  static constexpr size_t kMaxFreeBuffers = 8;
  static constexpr size_t kMaxFreeBytes = size_t{1} << 30;
  static constexpr size_t kAlignment = 64;  // as LibTorch's CPU allocator

  // The process's pool of receive buffers (never destroyed, so buffers that
  // outlive main's locals still have a pool to return to).
  static BufferPool& Receive();

  // `bytes` (> 0) of writable memory aligned to kAlignment, uninitialised;
  // the pointer's last owner gives it back. nullptr if the memory is not
  // there (the caller reports it; nothing is thrown).
  std::shared_ptr<uint8_t> Take(size_t bytes);

  // Off: Take allocates every buffer afresh and frees it after (the
  // benchmark's baseline, bench_transport --receive-pool off).
  void SetEnabled(bool enabled);

  struct Stats {
    int64_t reused = 0;     // Takes served from a free buffer
    int64_t allocated = 0;  // Takes of kMinBytes or more that allocated
    size_t free_buffers = 0;
    size_t free_bytes = 0;
  };
  Stats GetStats() const;

 private:
  struct Free {
    size_t bytes;
    uint8_t* data;
  };
  void Give(uint8_t* data, size_t bytes);

  mutable std::mutex mu_;
  bool enabled_ = true;
  std::vector<Free> free_;  // oldest first
  size_t free_bytes_ = 0;
  int64_t reused_ = 0;
  int64_t allocated_ = 0;
};

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_BUFFER_POOL_H_
