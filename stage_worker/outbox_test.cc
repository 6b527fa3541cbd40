#include "stage_worker/outbox.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <vector>

namespace pipemare {
namespace {

v1::StageMessage Message(uint64_t microbatch) {
  v1::StageMessage m;
  m.set_microbatch(microbatch);
  return m;
}

// A writer the test opens and closes like a stream whose peer stops reading.
struct GatedWriter {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  bool fail = false;
  std::vector<uint64_t> written;
  bool Write(const v1::StageMessage& m) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return open || fail; });
    if (fail) return false;
    written.push_back(m.microbatch());
    cv.notify_all();
    return true;
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
  void WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return written.size() >= n; });
  }
};

TEST(OutboxTest, WritesInOrder) {
  GatedWriter w;
  w.Open();
  Outbox box(
      4, [&](const v1::StageMessage& m) { return w.Write(m); }, [] {});
  for (uint64_t m = 1; m <= 100; ++m) ASSERT_TRUE(box.Push(Message(m)));
  w.WaitFor(100);
  for (uint64_t m = 1; m <= 100; ++m) EXPECT_EQ(w.written[m - 1], m);
  EXPECT_LE(box.high_water(), 4u);
}

TEST(OutboxTest, AFullOutboxBlocksTheProducerUntilTheStreamDrains) {
  GatedWriter w;  // closed: the peer reads nothing
  Outbox box(
      2, [&](const v1::StageMessage& m) { return w.Write(m); }, [] {});
  // One message is taken by the writer thread (stuck in Write), two queue.
  ASSERT_TRUE(box.Push(Message(1)));
  ASSERT_TRUE(box.Push(Message(2)));
  ASSERT_TRUE(box.Push(Message(3)));
  auto fourth = std::async(std::launch::async, [&] { return box.Push(Message(4)); });
  EXPECT_EQ(fourth.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  w.Open();
  EXPECT_TRUE(fourth.get());
  w.WaitFor(4);
  EXPECT_EQ(box.high_water(), 2u);
  EXPECT_GT(box.blocked_seconds(), 0.0);
}

TEST(OutboxTest, ABrokenStreamIsReportedOnceAndRefusesMore) {
  GatedWriter w;
  std::atomic<int> broken{0};
  Outbox box(
      2, [&](const v1::StageMessage& m) { return w.Write(m); }, [&] { ++broken; });
  ASSERT_TRUE(box.Push(Message(1)));
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.fail = true;
    w.cv.notify_all();
  }
  // The writer thread reports the break; afterwards Push refuses.
  for (int i = 0; i < 200 && broken == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(broken, 1);
  EXPECT_FALSE(box.Push(Message(2)));
  EXPECT_EQ(broken, 1);
}

TEST(OutboxTest, CloseWakesABlockedProducer) {
  GatedWriter w;
  Outbox box(
      1, [&](const v1::StageMessage& m) { return w.Write(m); }, [] {});
  ASSERT_TRUE(box.Push(Message(1)));  // taken by the writer, stuck
  ASSERT_TRUE(box.Push(Message(2)));  // queued: full
  auto blocked = std::async(std::launch::async, [&] { return box.Push(Message(3)); });
  EXPECT_EQ(blocked.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  box.Close();
  EXPECT_FALSE(blocked.get());
  w.Open();  // lets the writer thread finish so the destructor can join
}

}  // namespace
}  // namespace pipemare
