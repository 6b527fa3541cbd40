#include "stage_worker/gloo_edge.h"

#include <condition_variable>
#include <exception>
#include <stdexcept>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#ifdef PIPEMARE_HAVE_GLOO
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#endif

namespace pipemare {

#ifdef PIPEMARE_HAVE_GLOO

bool GlooAvailable() { return true; }

// The edge's rendezvous store: this end's keys, and the peer's as they
// arrive over the Pipe stream.
class GlooEdge::Store : public gloo::rendezvous::Store {
 public:
  explicit Store(SendKey send_key) : send_key_(std::move(send_key)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      keys_[key] = data;
    }
    cv_.notify_all();
    auto st = send_key_(key, std::string(data.begin(), data.end()));
    if (!st.ok()) throw std::runtime_error(absl::StrCat("rendezvous: ", st.message()));
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, kDefaultTimeout);
    std::lock_guard<std::mutex> lock(mu_);
    return keys_.at(key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, kDefaultTimeout); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    const bool done = cv_.wait_for(lock, timeout, [&] {
      if (!aborted_.empty()) return true;
      for (const auto& k : keys) {
        if (!keys_.count(k)) return false;
      }
      return true;
    });
    if (!aborted_.empty()) throw std::runtime_error(aborted_);
    if (!done) {
      throw std::runtime_error(
          absl::StrCat("rendezvous: the peer sent no address in ", timeout.count() / 1000.0, " s"));
    }
  }

  absl::Status Put(const std::string& key, const std::string& value) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (key.size() > 256 || value.size() > 64 * 1024) {
        return absl::InvalidArgumentError(absl::StrCat("data_plane_key: key of ", key.size(),
                                                       " bytes or value of ", value.size(),
                                                       " bytes; at most 256 and 65536"));
      }
      if (peer_keys_ >= 16) {
        return absl::InvalidArgumentError("data_plane_key: more than 16 rendezvous keys");
      }
      if (!keys_.emplace(key, std::vector<char>(value.begin(), value.end())).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("data_plane_key: key '", key, "' was already set"));
      }
      ++peer_keys_;
    }
    cv_.notify_all();
    return absl::OkStatus();
  }
  void Abort(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted_ = why;
    }
    cv_.notify_all();
  }

 private:
  const SendKey send_key_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> keys_;
  int peer_keys_ = 0;
  std::string aborted_;
};

class GlooEdge::Receive : public DataPlaneEdge::Receive {
 public:
  // The buffer goes first (members die in reverse order): Gloo's pair holds
  // it weakly and never writes through a destroyed one, so the memory stays
  // valid while Gloo may write into it.
  std::shared_ptr<void> owner;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  bool waited = false;
  // Posted before this end finished connecting (the peer may finish first
  // and send at once): posted to Gloo by Connect.
  uint64_t tag = 0;
  void* data = nullptr;
  size_t size = 0;
};

GlooEdge::GlooEdge(Options options, SendKey send_key)
    : options_(std::move(options)), store_(std::make_unique<Store>(std::move(send_key))) {}

GlooEdge::~GlooEdge() {
  Abort("the edge closed");
  // Pending buffers go before the context that made them.
  std::lock_guard<std::mutex> lock(mu_);
  sends_.clear();
}

absl::Status GlooEdge::Aborted() const {
  return absl::UnavailableError(absl::StrCat(options_.name, ": data plane: ", aborted_));
}

absl::Status GlooEdge::OnPeerKey(const std::string& key, const std::string& value) {
  return store_->Put(key, value);
}

absl::Status GlooEdge::Connect() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) return Aborted();
  }
  std::shared_ptr<gloo::rendezvous::Context> context;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options_.bind_host;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(options_.rank, 2);
    context->setTimeout(options_.connect_timeout);
    context->connectFullMesh(*store_, device);
    context->setTimeout(options_.wait_timeout);
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) return Aborted();
    return absl::UnavailableError(absl::StrCat(options_.name, ": data plane: cannot connect from ",
                                               options_.bind_host, ": ", e.what()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_.empty()) return Aborted();
  context_ = std::move(context);
  connected_ = true;
  for (auto& receive : deferred_) {
    try {
      receive->buffer = context_->createUnboundBuffer(receive->data, receive->size);
      receive->buffer->recv(1 - options_.rank, receive->tag);
      receives_[receive.get()] = receive;
    } catch (const std::exception& e) {
      aborted_ = e.what();
      receive->buffer.reset();
    }
  }
  deferred_.clear();
  connected_cv_.notify_all();
  return absl::OkStatus();
}

absl::Status GlooEdge::WaitOldestSend(std::unique_lock<std::mutex>& lock) {
  if (!aborted_.empty()) return Aborted();
  gloo::transport::UnboundBuffer* buffer = sends_.front().buffer.get();
  waiting_send_ = true;
  lock.unlock();
  std::string error;
  bool completed = false;
  try {
    completed = buffer->waitSend(options_.wait_timeout);
  } catch (const std::exception& e) {
    error = e.what();
  }
  lock.lock();
  waiting_send_ = false;
  sends_.pop_front();
  if (!aborted_.empty()) return Aborted();
  if (!completed) {
    aborted_ = error.empty() ? "a send was aborted" : error;
    return Aborted();
  }
  return absl::OkStatus();
}

absl::Status GlooEdge::Send(uint64_t tag, const void* data, size_t size,
                            std::shared_ptr<const void> owner) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!aborted_.empty()) return Aborted();
  if (!connected_)
    return absl::FailedPreconditionError(options_.name + ": data plane not connected");
  while (sends_.size() >= options_.max_sends_in_flight) {
    if (auto st = WaitOldestSend(lock); !st.ok()) return st;
  }
  try {
    // Gloo only reads a send's memory.
    auto buffer = context_->createUnboundBuffer(const_cast<void*>(data), size);
    buffer->send(1 - options_.rank, tag);
    sends_.push_back(PendingSend{std::move(owner), std::move(buffer)});
  } catch (const std::exception& e) {
    aborted_ = e.what();
    return Aborted();
  }
  return absl::OkStatus();
}

std::shared_ptr<DataPlaneEdge::Receive> GlooEdge::PostReceive(uint64_t tag, void* data, size_t size,
                                                              std::shared_ptr<void> owner) {
  auto receive = std::make_shared<Receive>();
  receive->owner = std::move(owner);
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_.empty()) return receive;  // Wait() says why
  if (!connected_) {
    receive->tag = tag;
    receive->data = data;
    receive->size = size;
    deferred_.push_back(receive);
    return receive;
  }
  try {
    receive->buffer = context_->createUnboundBuffer(data, size);
    receive->buffer->recv(1 - options_.rank, tag);
    receives_[receive.get()] = receive;
  } catch (const std::exception& e) {
    aborted_ = e.what();
    receive->buffer.reset();
  }
  return receive;
}

absl::Status GlooEdge::Wait(DataPlaneEdge::Receive& posted) {
  // Only this edge's PostReceive makes them.
  Receive& receive = static_cast<Receive&>(posted);
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (receive.waited) return absl::OkStatus();
    // A receive posted before Connect finished is posted by it.
    connected_cv_.wait(lock, [&] { return receive.buffer != nullptr || !aborted_.empty(); });
    if (!aborted_.empty()) return Aborted();
  }
  std::string error;
  bool completed = false;
  try {
    completed = receive.buffer->waitRecv(options_.wait_timeout);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(mu_);
  receives_.erase(&receive);
  if (!aborted_.empty()) return Aborted();
  if (!completed) {
    aborted_ = error.empty() ? "a receive was aborted" : error;
    return Aborted();
  }
  receive.waited = true;
  return absl::OkStatus();
}

void GlooEdge::Abort(const std::string& why) {
  store_->Abort(why);
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.empty()) aborted_ = why;
  connected_cv_.notify_all();
  if (waiting_send_ && !sends_.empty()) sends_.front().buffer->abortWaitSend();
  for (auto& [key, weak] : receives_) {
    if (auto receive = weak.lock(); receive && receive->buffer) receive->buffer->abortWaitRecv();
  }
}

#else  // !PIPEMARE_HAVE_GLOO

bool GlooAvailable() { return false; }

class GlooEdge::Store {};
class GlooEdge::Receive : public DataPlaneEdge::Receive {};

GlooEdge::GlooEdge(Options options, SendKey) : options_(std::move(options)) {}
GlooEdge::~GlooEdge() = default;
absl::Status GlooEdge::Aborted() const { return absl::UnavailableError(aborted_); }
absl::Status GlooEdge::OnPeerKey(const std::string&, const std::string&) {
  return absl::UnimplementedError("this worker was built without Gloo (PIPEMARE_GLOO=OFF)");
}
absl::Status GlooEdge::Connect() { return OnPeerKey("", ""); }
absl::Status GlooEdge::WaitOldestSend(std::unique_lock<std::mutex>&) { return Connect(); }
absl::Status GlooEdge::Send(uint64_t, const void*, size_t, std::shared_ptr<const void>) {
  return Connect();
}
std::shared_ptr<DataPlaneEdge::Receive> GlooEdge::PostReceive(uint64_t, void*, size_t,
                                                              std::shared_ptr<void>) {
  return std::make_shared<Receive>();
}
absl::Status GlooEdge::Wait(DataPlaneEdge::Receive&) { return Connect(); }
void GlooEdge::Abort(const std::string&) {}

#endif  // PIPEMARE_HAVE_GLOO

absl::StatusOr<std::unique_ptr<DataPlaneEdge>> MakeDataPlaneEdge(Transport transport,
                                                                 DataPlaneEdge::Options options,
                                                                 DataPlaneEdge::SendKey send_key) {
  if (transport == Transport::kGrpc) return nullptr;
  if (!GlooAvailable()) {
    return absl::FailedPreconditionError(
        "schedule.transport: gloo, but this worker was built without Gloo (PIPEMARE_GLOO=OFF); "
        "use transport: grpc or a worker built with libgloo-dev");
  }
  return std::make_unique<GlooEdge>(std::move(options), std::move(send_key));
}

}  // namespace pipemare
