// PipeStream: one end of a `StageWorker.Pipe` stream, on gRPC's callback API
// with raw byte buffers (common/pipe_wire.h), the same for both ends: a
// stage's stream to its downstream neighbour and the coordinator's feeds
// (OpenPipe, the client end), and a stage's incoming streams (ServePipe, the
// server end).
//
//   - Sending: Send() queues an encoded message and returns; gRPC writes one
//     message at a time, the next starting from the reaction to the last
//     (no thread of ours per stream). The queue is bounded: Send() waits
//     while it is full, which is the backpressure that keeps a fast stage
//     from piling messages up in front of a slow one. Never call Send() from
//     a reaction (the callbacks below).
//   - Receiving: each message is decoded and handed to `on_message` on a gRPC
//     thread; it must not block. Returning false stops reading (the receiver
//     is full; HTTP/2 flow control then pushes back on the sender) until
//     ResumeReading().
//   - Ending: `on_end` runs once, when the stream is over (the peer finished
//     or vanished, a write failed, or Close()); no callback runs after it.
#ifndef PIPEMARE_COMMON_PIPE_STREAM_H_
#define PIPEMARE_COMMON_PIPE_STREAM_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_callback.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "common/pipe_wire.h"

namespace pipemare {

class PipeStream {
 public:
  struct Callbacks {
    // A message arrived (or could not be decoded). False: stop reading until
    // ResumeReading().
    std::function<bool(absl::StatusOr<PipeMessage>)> on_message;
    // The stream is over: the peer's status (client end) or how it ended.
    std::function<void(const grpc::Status&)> on_end;
  };

  // Queues `message`; waits while `capacity` messages are queued. False once
  // the stream is ending (then the message is dropped).
  bool Send(grpc::ByteBuffer message);
  // Drops what is queued, sends `last` after the write in flight, and
  // accepts no more: how a failing stage tells its neighbours why.
  void SendLast(grpc::ByteBuffer last);
  // Reading resumes after on_message returned false. Any thread.
  void ResumeReading();
  // Ends the stream now (cancels it); on_end follows. Any thread but a
  // reaction's. Idempotent.
  void Close();
  // Close() and wait for on_end to have run: after it, no callback of this
  // stream runs.
  void CloseAndWait();
  // Sets where messages go and the send queue's bound (the server end gets
  // them once the stream's first message, its StreamOpen, was read).
  void SetCallbacks(Callbacks callbacks, size_t capacity);

  // The most messages queued at once, and seconds Send() waited for room.
  size_t high_water() const;
  double blocked_seconds() const;

  // What the two reactors implement (pipe_stream.cc).
  class Ops {
   public:
    virtual ~Ops() = default;
    virtual void DoRead(grpc::ByteBuffer* buffer) = 0;
    virtual void DoWrite(const grpc::ByteBuffer* buffer) = 0;
    virtual void DoCancel() = 0;
    // No op of ours will start again: the client drops its hold, the server
    // finishes the call with `status`. The reactor may be gone after it.
    virtual void DoRelease(const grpc::Status& status) = 0;
  };
  explicit PipeStream(Ops* ops) : ops_(ops) {}
  // Reactions, called by the reactors only.
  void OnReadDone(bool ok);
  void OnWriteDone(bool ok);
  void OnDone(const grpc::Status& status);
  // Starts the first read.
  void StartReading();
  // Ends the stream with `status` (server end: the status the call finishes
  // with); `cancel`: cancel the call first.
  void CloseWith(const grpc::Status& status, bool cancel);

 private:
  // Whether DoRelease is due now: no op of ours is or will be in flight.
  bool ReleaseDueLocked();
  // Runs `fn` on the reactor unless it was released, then releases it if
  // that is due.
  void CallOps(const std::function<void(Ops*)>& fn);

  Ops* ops_;  // the reactor; valid until released
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<const Callbacks> callbacks_ = std::make_shared<Callbacks>();
  size_t capacity_ = 1;
  std::deque<grpc::ByteBuffer> queue_;
  grpc::ByteBuffer writing_buffer_;  // the write in flight (its starter's)
  grpc::ByteBuffer read_buffer_;     // the read in flight
  bool writing_ = false;             // a write is in flight
  bool accepting_ = true;            // Send() still queues
  bool reading_ = false;             // a read is in flight (or its reaction runs)
  bool read_paused_ = false;         // on_message said stop
  bool resume_wanted_ = false;       // ResumeReading before the pause landed
  bool reads_over_ = false;          // no read will start again
  int ops_busy_ = 0;                 // calls into the reactor under way
  bool closing_ = false;
  bool released_ = false;
  bool done_ = false;   // OnDone ran
  bool ended_ = false;  // on_end returned
  grpc::Status finish_status_;
  size_t high_water_ = 0;
  double blocked_seconds_ = 0;
};

// Opens a Pipe stream to `channel`'s StageWorker, sends `open` first and
// starts reading. The stream belongs to gRPC until on_end has run; the
// returned handle stays valid (Send fails) after that.
std::shared_ptr<PipeStream> OpenPipe(const std::shared_ptr<grpc::Channel>& channel,
                                     grpc::ByteBuffer open, PipeStream::Callbacks callbacks,
                                     size_t capacity);

// The server end: reads the stream's first message and hands it to `accept`
// with the stream, on a gRPC thread. `accept` calls SetCallbacks and returns
// OK to take the stream, or the status to end it with.
using PipeAcceptor =
    std::function<grpc::Status(absl::StatusOr<PipeMessage>, std::shared_ptr<PipeStream>)>;
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ServePipe(
    grpc::CallbackServerContext* context, PipeAcceptor accept);

// The method's full name, for generic stubs.
inline constexpr char kPipeMethod[] = "/pipemare.v1.StageWorker/Pipe";

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_PIPE_STREAM_H_
