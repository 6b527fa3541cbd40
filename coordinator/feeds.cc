#include "coordinator/feeds.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pipemare {

Feeds::Feeds(std::string job_id, int64_t generation, size_t window)
    : job_id_(std::move(job_id)), generation_(generation), window_(window) {}

Feeds::~Feeds() { Close(); }

void Feeds::Open(std::shared_ptr<grpc::Channel> first, std::string first_label,
                 std::shared_ptr<grpc::Channel> last, std::string last_label) {
  OpenFeed(target_, std::move(last), last_label, v1::StreamOpen::TARGET_FEED);
  OpenFeed(input_, std::move(first), first_label, v1::StreamOpen::INPUT_FEED);
}

void Feeds::OpenFeed(Feed& feed, std::shared_ptr<grpc::Channel> channel, const std::string& label,
                     v1::StreamOpen::Role role) {
  v1::StageMessage open;
  open.mutable_open()->set_job_id(job_id_);
  open.mutable_open()->set_role(role);
  open.mutable_open()->set_from_stage(-1);
  open.mutable_open()->set_generation(generation_);
  feed.what =
      absl::StrCat(role == v1::StreamOpen::INPUT_FEED ? "input" : "target", " feed to ", label);
  PipeStream::Callbacks callbacks;
  callbacks.on_message = [this, what = feed.what](absl::StatusOr<PipeMessage> m) {
    OnMessage(what, std::move(m));
    return true;  // results and acks are small and bounded by the window
  };
  callbacks.on_end = [this, what = feed.what](const grpc::Status& st) {
    FeedEvent e;
    e.kind = FeedEvent::kError;
    e.error =
        absl::StrCat("lost the ", what, st.ok() ? "" : absl::StrCat(": ", st.error_message()));
    Push(std::move(e));
  };
  // Sends queue behind at most the in-flight window.
  feed.stream = OpenPipe(channel, EncodePipeMessage(open), std::move(callbacks), window_);
}

void Feeds::OnMessage(const std::string& what, absl::StatusOr<PipeMessage> m) {
  FeedEvent e;
  e.kind = FeedEvent::kError;
  if (!m.ok()) {
    e.error = absl::StrCat(what, ": ", m.status().message());
  } else {
    const v1::StageMessage& msg = m->message;
    e.microbatch = msg.microbatch();
    e.phase = msg.phase();
    if (msg.has_done()) {
      e.kind = FeedEvent::kDone;
    } else if (msg.has_result()) {
      e.kind = FeedEvent::kResult;
      e.result = msg.result();
      e.skipped = msg.skipped();
    } else if (msg.has_error()) {
      e.error = msg.error().message();
      if (msg.error().code() != 0) e.code = static_cast<absl::StatusCode>(msg.error().code());
    } else {
      e.error = absl::StrCat(what, " sent an unexpected message");
    }
  }
  Push(std::move(e));
}

void Feeds::Push(FeedEvent e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

std::optional<FeedEvent> Feeds::Next(std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, wait, [&] { return !events_.empty() || woken_; });
  woken_ = false;
  if (events_.empty()) return std::nullopt;
  FeedEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void Feeds::Wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    woken_ = true;
  }
  cv_.notify_all();
}

void Feeds::Close() {
  for (Feed* f : {&input_, &target_}) {
    if (!f->stream) continue;
    f->stream->CloseAndWait();  // after it, no event from this feed
    f->stream.reset();
  }
}

absl::Status Feeds::Send(const Examples& data, const std::vector<int64_t>& order, int64_t begin,
                         int64_t count, uint64_t id, v1::Phase phase) {
  if (!input_.stream || !target_.stream) return absl::UnavailableError("the feeds are closed");
  const int64_t in_size = data.InputSize(), target_size = data.TargetSize();
  const bool tokens = data.token_input();
  // The feed sends these buffers as they are (common/pipe_wire.h): each
  // message's payload slice keeps its buffer until gRPC has written it.
  auto x = std::make_shared<std::vector<float>>(tokens ? 0 : count * in_size);
  auto t = std::make_shared<std::vector<int64_t>>(tokens ? count * in_size : 0);
  auto y = std::make_shared<std::vector<int64_t>>(count * target_size);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t src = order.empty() ? begin + j : order[begin + j];
    if (tokens) {
      std::copy_n(data.tokens.data() + src * in_size, in_size, t->data() + j * in_size);
    } else {
      std::copy_n(data.inputs.data() + src * in_size, in_size, x->data() + j * in_size);
    }
    std::copy_n(data.targets.data() + src * target_size, target_size, y->data() + j * target_size);
  }
  v1::StageMessage targets;
  targets.set_microbatch(id);
  targets.set_phase(phase);
  targets.mutable_targets()->set_dtype(v1::INT64);
  targets.mutable_targets()->add_shape(count);
  for (int64_t d : data.target_shape) targets.mutable_targets()->add_shape(d);
  v1::StageMessage input;
  input.set_microbatch(id);
  input.set_phase(phase);
  input.mutable_activation()->set_dtype(tokens ? v1::INT64 : v1::FLOAT32);
  input.mutable_activation()->add_shape(count);
  for (int64_t d : data.input_shape) input.mutable_activation()->add_shape(d);
  WirePayload in_payload = tokens ? WirePayload{t->data(), t->size() * sizeof(int64_t), t}
                                  : WirePayload{x->data(), x->size() * sizeof(float), x};
  // Targets first, so the last stage has them when the activation arrives.
  if (!target_.stream->Send(
          EncodePipeMessage(targets, {y->data(), y->size() * sizeof(int64_t), y}))) {
    return absl::UnavailableError(absl::StrCat("lost the ", target_.what));
  }
  if (!input_.stream->Send(EncodePipeMessage(input, std::move(in_payload)))) {
    return absl::UnavailableError(absl::StrCat("lost the ", input_.what));
  }
  return absl::OkStatus();
}

}  // namespace pipemare
