// Two ends of a Gloo edge in one process over loopback: the rendezvous keys
// go straight from one end to the other instead of over a Pipe stream.
#include "stage_worker/gloo_edge.h"

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstring>
#include <future>
#include <numeric>
#include <thread>
#include <vector>

namespace pipemare {
namespace {

using std::chrono::milliseconds;

struct Pair {
  std::unique_ptr<GlooEdge> up, down;  // rank 0, rank 1
};

GlooEdge::Options EdgeOptions(int rank, size_t max_sends = 8) {
  GlooEdge::Options o;
  o.rank = rank;
  o.bind_host = "127.0.0.1";
  o.connect_timeout = milliseconds(10000);
  o.wait_timeout = milliseconds(20000);
  o.max_sends_in_flight = max_sends;
  o.name = rank == 0 ? "edge up" : "edge down";
  return o;
}

// Both ends, each sending its rendezvous keys straight to the other; not
// yet connected.
Pair Unconnected(size_t max_sends = 8) {
  // The edges live on the heap; the pair itself may move.
  auto peers = std::make_shared<std::array<GlooEdge*, 2>>();
  Pair p;
  p.up = std::make_unique<GlooEdge>(
      EdgeOptions(0, max_sends),
      [peers](const std::string& k, const std::string& v) { return (*peers)[1]->OnPeerKey(k, v); });
  p.down = std::make_unique<GlooEdge>(
      EdgeOptions(1, max_sends),
      [peers](const std::string& k, const std::string& v) { return (*peers)[0]->OnPeerKey(k, v); });
  *peers = {p.up.get(), p.down.get()};
  return p;
}

void ConnectBoth(Pair& p) {
  auto a = std::async(std::launch::async, [&] { return p.up->Connect(); });
  auto b = std::async(std::launch::async, [&] { return p.down->Connect(); });
  EXPECT_TRUE(a.get().ok());
  EXPECT_TRUE(b.get().ok());
}

Pair Connected(size_t max_sends = 8) {
  Pair p = Unconnected(max_sends);
  ConnectBoth(p);
  return p;
}

std::shared_ptr<std::vector<char>> Bytes(size_t n, int seed) {
  auto v = std::make_shared<std::vector<char>>(n);
  for (size_t i = 0; i < n; ++i) (*v)[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return v;
}

TEST(GlooEdgeTest, BytesArriveIntactBothWaysAndMatchByTag) {
  if (!GlooAvailable()) GTEST_SKIP() << "built with PIPEMARE_GLOO=OFF";
  Pair p = Connected();
  for (size_t n : {size_t{1}, size_t{65536}, size_t{4} << 20}) {
    // Two tags each way, received in the other order than they were sent.
    auto a1 = Bytes(n, 1), a2 = Bytes(n, 2), g1 = Bytes(n, 3);
    auto in1 = std::make_shared<std::vector<char>>(n), in2 = std::make_shared<std::vector<char>>(n);
    auto gin = std::make_shared<std::vector<char>>(n);
    auto r2 = p.down->PostReceive(GlooEdge::Tag(2, false), in2->data(), n, in2);
    auto r1 = p.down->PostReceive(GlooEdge::Tag(1, false), in1->data(), n, in1);
    auto rg = p.up->PostReceive(GlooEdge::Tag(1, true), gin->data(), n, gin);
    ASSERT_TRUE(p.up->Send(GlooEdge::Tag(1, false), a1->data(), n, a1).ok());
    ASSERT_TRUE(p.up->Send(GlooEdge::Tag(2, false), a2->data(), n, a2).ok());
    ASSERT_TRUE(p.down->Send(GlooEdge::Tag(1, true), g1->data(), n, g1).ok());
    ASSERT_TRUE(p.down->Wait(*r1).ok());
    ASSERT_TRUE(p.down->Wait(*r2).ok());
    ASSERT_TRUE(p.up->Wait(*rg).ok());
    EXPECT_EQ(*in1, *a1) << n;
    EXPECT_EQ(*in2, *a2) << n;
    EXPECT_EQ(*gin, *g1) << n;
  }
}

// The peer may finish connecting first and send at once, while this end's
// headers already arrived: a receive posted (and waited for) before Connect
// finished is posted by Connect and gets its bytes.
TEST(GlooEdgeTest, AReceivePostedBeforeConnectGetsItsBytes) {
  if (!GlooAvailable()) GTEST_SKIP() << "built with PIPEMARE_GLOO=OFF";
  Pair p = Unconnected();
  const size_t n = 1 << 20;
  auto sent = Bytes(n, 7);
  auto in = std::make_shared<std::vector<char>>(n);
  auto r = p.down->PostReceive(GlooEdge::Tag(0, false), in->data(), n, in);
  auto waited = std::async(std::launch::async, [&] { return p.down->Wait(*r); });
  EXPECT_EQ(waited.wait_for(milliseconds(50)), std::future_status::timeout);
  ConnectBoth(p);
  ASSERT_TRUE(p.up->Send(GlooEdge::Tag(0, false), sent->data(), n, sent).ok());
  ASSERT_TRUE(waited.get().ok());
  EXPECT_EQ(*in, *sent);
}

TEST(GlooEdgeTest, AbortWakesAWaitingReceive) {
  if (!GlooAvailable()) GTEST_SKIP() << "built with PIPEMARE_GLOO=OFF";
  Pair p = Connected();
  auto in = std::make_shared<std::vector<char>>(16);
  auto r = p.down->PostReceive(7, in->data(), 16, in);
  auto waited = std::async(std::launch::async, [&] { return p.down->Wait(*r); });
  EXPECT_EQ(waited.wait_for(milliseconds(200)), std::future_status::timeout);
  p.down->Abort("the stage stops");
  ASSERT_EQ(waited.wait_for(milliseconds(5000)), std::future_status::ready);
  absl::Status st = waited.get();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("the stage stops"), std::string::npos) << st;
  // Everything after fails at once.
  auto out = Bytes(16, 0);
  EXPECT_FALSE(p.down->Send(8, out->data(), 16, out).ok());
}

TEST(GlooEdgeTest, APeerThatGoesAwayFailsTheWaitInsteadOfHanging) {
  if (!GlooAvailable()) GTEST_SKIP() << "built with PIPEMARE_GLOO=OFF";
  Pair p = Connected();
  auto in = std::make_shared<std::vector<char>>(1024);
  auto r = p.down->PostReceive(3, in->data(), 1024, in);
  auto waited = std::async(std::launch::async, [&] { return p.down->Wait(*r); });
  std::this_thread::sleep_for(milliseconds(100));
  p.up.reset();  // its sockets close, as when its process dies
  ASSERT_EQ(waited.wait_for(milliseconds(10000)), std::future_status::ready);
  absl::Status st = waited.get();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
}

TEST(GlooEdgeTest, SendsWaitForTheReceiverBeyondTheWindowAndAbortReleasesThem) {
  if (!GlooAvailable()) GTEST_SKIP() << "built with PIPEMARE_GLOO=OFF";
  Pair p = Connected(/*max_sends=*/2);
  auto out = Bytes(4096, 5);
  ASSERT_TRUE(p.up->Send(1, out->data(), out->size(), out).ok());
  ASSERT_TRUE(p.up->Send(2, out->data(), out->size(), out).ok());
  auto third =
      std::async(std::launch::async, [&] { return p.up->Send(3, out->data(), out->size(), out); });
  EXPECT_EQ(third.wait_for(milliseconds(300)), std::future_status::timeout);
  // The receiver takes the first: the third is posted.
  auto in = std::make_shared<std::vector<char>>(4096);
  auto r = p.down->PostReceive(1, in->data(), in->size(), in);
  ASSERT_TRUE(p.down->Wait(*r).ok());
  ASSERT_EQ(third.wait_for(milliseconds(5000)), std::future_status::ready);
  EXPECT_TRUE(third.get().ok());
  // Window full again (2 and 3 pending): a fourth waits until Abort.
  auto fourth =
      std::async(std::launch::async, [&] { return p.up->Send(4, out->data(), out->size(), out); });
  EXPECT_EQ(fourth.wait_for(milliseconds(300)), std::future_status::timeout);
  p.up->Abort("cancelled");
  ASSERT_EQ(fourth.wait_for(milliseconds(5000)), std::future_status::ready);
  EXPECT_EQ(fourth.get().code(), absl::StatusCode::kUnavailable);
}

TEST(GlooEdgeTest, RendezvousRefusesBadKeysAndTimesOutWithoutAPeer) {
  if (!GlooAvailable()) GTEST_SKIP() << "built with PIPEMARE_GLOO=OFF";
  GlooEdge::Options o = EdgeOptions(0);
  o.connect_timeout = milliseconds(300);
  GlooEdge lonely(o, [](const std::string&, const std::string&) { return absl::OkStatus(); });
  EXPECT_TRUE(lonely.OnPeerKey("1", "addr").ok());
  EXPECT_EQ(lonely.OnPeerKey("1", "again").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lonely.OnPeerKey("big", std::string(70000, 'x')).code(),
            absl::StatusCode::kInvalidArgument);
  GlooEdge o2(o, [](const std::string&, const std::string&) { return absl::OkStatus(); });
  const auto start = std::chrono::steady_clock::now();
  absl::Status st = o2.Connect();  // nobody answers
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(DataPlaneTest, EachTransportMakesItsEdge) {
  auto none = [](const std::string&, const std::string&) { return absl::OkStatus(); };
  for (const char* grpc : {"", "grpc"}) {
    auto edge = MakeDataPlaneEdge(TransportOf(grpc), EdgeOptions(0), none);
    ASSERT_TRUE(edge.ok()) << edge.status();
    EXPECT_EQ(*edge, nullptr) << "the stream carries the bytes";
  }
  // An unknown transport is refused where the name is parsed, naming both.
  auto bad = ParseTransport("tcp");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("allowed: grpc (default), gloo"), std::string::npos);
  auto gloo = MakeDataPlaneEdge(Transport::kGloo, EdgeOptions(0), none);
  if (GlooAvailable()) {
    ASSERT_TRUE(gloo.ok()) << gloo.status();
    EXPECT_NE(*gloo, nullptr);
  } else {
    EXPECT_EQ(gloo.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(gloo.status().message().find("PIPEMARE_GLOO=OFF"), std::string::npos);
  }
}

TEST(GlooEdgeTest, WithoutGlooEveryCallSaysHowItWasBuilt) {
  if (GlooAvailable()) GTEST_SKIP() << "built with Gloo";
  GlooEdge e(EdgeOptions(0),
             [](const std::string&, const std::string&) { return absl::OkStatus(); });
  absl::Status st = e.Connect();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(st.message().find("PIPEMARE_GLOO"), std::string::npos);
}

}  // namespace
}  // namespace pipemare
