#include "common/pipe_stream.h"

#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <chrono>
#include <utility>

namespace pipemare {

// Locking: mu_ guards the state; no call into gRPC is made while holding it
// (gRPC may run a reaction inline, which takes mu_). A call into the reactor
// is announced first (writing_, reading_ or ops_busy_), so the reactor
// cannot be released, and so freed, while it runs.

void PipeStream::SetCallbacks(Callbacks callbacks, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  callbacks_ = std::make_shared<const Callbacks>(std::move(callbacks));
  capacity_ = std::max<size_t>(capacity, 1);
  cv_.notify_all();
}

bool PipeStream::ReleaseDueLocked() {
  return !released_ && ops_busy_ == 0 && !writing_ && !reading_ && (reads_over_ || closing_);
}

void PipeStream::CallOps(const std::function<void(Ops*)>& fn) {
  Ops* ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) return;
    ++ops_busy_;
    ops = ops_;
  }
  if (fn) fn(ops);
  bool release;
  grpc::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --ops_busy_;
    release = ReleaseDueLocked();
    if (release) released_ = true;
    status = finish_status_;
  }
  if (release) ops->DoRelease(status);
}

bool PipeStream::Send(grpc::ByteBuffer message) {
  std::unique_lock<std::mutex> lock(mu_);
  if (accepting_ && queue_.size() >= capacity_) {
    const auto start = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return !accepting_ || queue_.size() < capacity_; });
    blocked_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (!accepting_) return false;
  if (writing_) {
    queue_.push_back(std::move(message));
    high_water_ = std::max(high_water_, queue_.size());
    return true;
  }
  writing_ = true;  // the write token: only its holder touches writing_buffer_
  writing_buffer_ = std::move(message);
  Ops* ops = ops_;
  lock.unlock();
  ops->DoWrite(&writing_buffer_);
  return true;
}

void PipeStream::SendLast(grpc::ByteBuffer last) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!accepting_) return;
  accepting_ = false;
  queue_.clear();
  cv_.notify_all();
  if (writing_) {
    queue_.push_back(std::move(last));
    return;
  }
  writing_ = true;
  writing_buffer_ = std::move(last);
  Ops* ops = ops_;
  lock.unlock();
  ops->DoWrite(&writing_buffer_);
}

void PipeStream::OnWriteDone(bool ok) {
  bool start = false, cancel = false;
  Ops* ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ops = ops_;
    if (!ok) {
      // The stream broke: nothing more goes out, and the reads end too.
      accepting_ = false;
      queue_.clear();
      cancel = !closing_;
      closing_ = true;
    } else if (!queue_.empty() && !closing_) {
      writing_buffer_ = std::move(queue_.front());
      queue_.pop_front();
      start = true;
    }
    writing_ = start;
    if (cancel) ++ops_busy_;
    cv_.notify_all();  // room for a waiting Send
  }
  if (start) ops->DoWrite(&writing_buffer_);
  if (cancel) {
    ops->DoCancel();
    {
      std::lock_guard<std::mutex> lock(mu_);
      --ops_busy_;
    }
  }
  if (!start) CallOps(nullptr);  // releases the reactor if that is due
}

void PipeStream::StartReading() {
  Ops* ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reading_ || reads_over_ || closing_) return;
    reading_ = true;
    ops = ops_;
  }
  ops->DoRead(&read_buffer_);
}

void PipeStream::OnReadDone(bool ok) {
  if (!ok) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      reads_over_ = true;
      accepting_ = false;  // the peer is gone or done: no one to send to
      queue_.clear();
      cv_.notify_all();
    }
    CallOps(nullptr);
    return;
  }
  absl::StatusOr<PipeMessage> message = PipeMessage{};
  if (auto st = DecodePipeMessage(read_buffer_, &*message); !st.ok()) message = st;
  read_buffer_.Clear();
  std::shared_ptr<const Callbacks> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    callbacks = callbacks_;
  }
  const bool more = callbacks->on_message ? callbacks->on_message(std::move(message)) : false;
  bool start = false;
  Ops* ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ops = ops_;
    if (!closing_ && !reads_over_) {
      if (more || resume_wanted_) {
        start = true;
      } else {
        read_paused_ = true;
      }
      resume_wanted_ = false;
    }
    reading_ = start;
  }
  if (start) {
    ops->DoRead(&read_buffer_);
  } else {
    CallOps(nullptr);
  }
}

void PipeStream::ResumeReading() {
  Ops* ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_ || reads_over_ || released_) return;
    if (!read_paused_) {
      // The reaction that pauses has not finished: it will read on.
      if (reading_) resume_wanted_ = true;
      return;
    }
    read_paused_ = false;
    reading_ = true;
    ops = ops_;
  }
  ops->DoRead(&read_buffer_);
}

void PipeStream::CloseWith(const grpc::Status& status, bool cancel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_ || released_) return;
    closing_ = true;
    accepting_ = false;
    queue_.clear();
    finish_status_ = status;
    cv_.notify_all();
  }
  if (cancel) {
    CallOps([](Ops* ops) { ops->DoCancel(); });
  } else {
    CallOps(nullptr);
  }
}

void PipeStream::Close() {
  CloseWith(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed"), true);
}

void PipeStream::CloseAndWait() {
  Close();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return ended_; });
}

void PipeStream::OnDone(const grpc::Status& status) {
  std::shared_ptr<const Callbacks> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    released_ = true;
    ops_ = nullptr;
    accepting_ = false;
    queue_.clear();
    callbacks = callbacks_;
    cv_.notify_all();
  }
  if (callbacks->on_end) callbacks->on_end(status);
  std::lock_guard<std::mutex> lock(mu_);
  ended_ = true;
  cv_.notify_all();
}

size_t PipeStream::high_water() const {
  std::lock_guard<std::mutex> lock(mu_);
  return high_water_;
}

double PipeStream::blocked_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocked_seconds_;
}

namespace {

class ClientPipe final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                         public PipeStream::Ops {
 public:
  ClientPipe() : stream_(std::make_shared<PipeStream>(this)) {}
  grpc::ClientContext* context() { return &context_; }
  const std::shared_ptr<PipeStream>& stream() { return stream_; }

  void DoRead(grpc::ByteBuffer* buffer) override { StartRead(buffer); }
  void DoWrite(const grpc::ByteBuffer* buffer) override { StartWrite(buffer); }
  void DoCancel() override { context_.TryCancel(); }
  void DoRelease(const grpc::Status&) override { RemoveHold(); }

  void OnReadDone(bool ok) override { stream_->OnReadDone(ok); }
  void OnWriteDone(bool ok) override { stream_->OnWriteDone(ok); }
  void OnDone(const grpc::Status& status) override {
    stream_->OnDone(status);
    delete this;
  }

 private:
  grpc::ClientContext context_;
  std::shared_ptr<PipeStream> stream_;
};

class ServerPipe final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                         public PipeStream::Ops {
 public:
  ServerPipe(grpc::CallbackServerContext* context, PipeAcceptor accept)
      : context_(context), stream_(std::make_shared<PipeStream>(this)) {
    // The first message is the stream's StreamOpen: `accept` decides.
    PipeStream::Callbacks first;
    first.on_message = [s = stream_.get(), accept = std::move(accept),
                        weak = std::weak_ptr<PipeStream>(stream_)](absl::StatusOr<PipeMessage> m) {
      grpc::Status st = accept(std::move(m), weak.lock());
      if (!st.ok()) s->CloseWith(st, false);
      return st.ok();
    };
    stream_->SetCallbacks(std::move(first), 1);
    stream_->StartReading();
  }

  void DoRead(grpc::ByteBuffer* buffer) override { StartRead(buffer); }
  void DoWrite(const grpc::ByteBuffer* buffer) override { StartWrite(buffer); }
  void DoCancel() override { context_->TryCancel(); }
  void DoRelease(const grpc::Status& status) override { Finish(status); }

  void OnReadDone(bool ok) override { stream_->OnReadDone(ok); }
  void OnWriteDone(bool ok) override { stream_->OnWriteDone(ok); }
  // The peer went away or the call was cancelled: the reads and writes in
  // flight fail, and a stream that paused its reads ends now rather than
  // when the stage stops.
  void OnCancel() override {
    stream_->CloseWith(grpc::Status(grpc::StatusCode::CANCELLED, "the peer went away"), false);
  }
  void OnDone() override {
    stream_->OnDone(context_->IsCancelled()
                        ? grpc::Status(grpc::StatusCode::CANCELLED, "the peer went away")
                        : grpc::Status::OK);
    delete this;
  }

 private:
  grpc::CallbackServerContext* context_;
  std::shared_ptr<PipeStream> stream_;
};

}  // namespace

std::shared_ptr<PipeStream> OpenPipe(const std::shared_ptr<grpc::Channel>& channel,
                                     grpc::ByteBuffer open, PipeStream::Callbacks callbacks,
                                     size_t capacity) {
  auto* call = new ClientPipe();
  std::shared_ptr<PipeStream> stream = call->stream();
  stream->SetCallbacks(std::move(callbacks), capacity);
  grpc::GenericStub stub(channel);
  stub.PrepareBidiStreamingCall(call->context(), kPipeMethod, grpc::StubOptions(), call);
  // Reads resume and writes start from outside the reactions: a hold keeps
  // the call until the stream releases it.
  call->AddHold();
  stream->Send(std::move(open));
  stream->StartReading();
  call->StartCall();
  return stream;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ServePipe(
    grpc::CallbackServerContext* context, PipeAcceptor accept) {
  return new ServerPipe(context, std::move(accept));
}

}  // namespace pipemare
