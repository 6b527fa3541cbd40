#include "coordinator/feeds.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"

namespace pipemare {

Feeds::Feeds(std::string job_id, int64_t generation, size_t window)
    : job_id_(std::move(job_id)), generation_(generation), window_(window) {}

Feeds::~Feeds() { Close(); }

void Feeds::Open(const std::vector<Ends>& replicas) {
  feeds_.resize(replicas.size());
  for (size_t r = 0; r < replicas.size(); ++r) {
    const Ends& e = replicas[r];
    OpenFeed(feeds_[r].target, static_cast<int>(r), e.last, e.last_label,
             v1::StreamOpen::TARGET_FEED);
    OpenFeed(feeds_[r].input, static_cast<int>(r), e.first, e.first_label,
             v1::StreamOpen::INPUT_FEED);
  }
}

void Feeds::OpenFeed(Feed& feed, int replica, std::shared_ptr<grpc::Channel> channel,
                     const std::string& label, v1::StreamOpen::Role role) {
  v1::StageMessage open;
  open.mutable_open()->set_job_id(job_id_);
  open.mutable_open()->set_role(role);
  open.mutable_open()->set_from_stage(-1);
  open.mutable_open()->set_generation(generation_);
  feed.what =
      absl::StrCat(role == v1::StreamOpen::INPUT_FEED ? "input" : "target", " feed to ", label);
  PipeStream::Callbacks callbacks;
  callbacks.on_message = [this, replica, what = feed.what](absl::StatusOr<PipeMessage> m) {
    OnMessage(replica, what, std::move(m));
    return true;  // results and acks are small and bounded by the window
  };
  callbacks.on_end = [this, replica, what = feed.what](const grpc::Status& st) {
    FeedEvent e;
    e.kind = FeedEvent::kError;
    e.replica = replica;
    e.error =
        absl::StrCat("lost the ", what, st.ok() ? "" : absl::StrCat(": ", st.error_message()));
    Push(std::move(e));
  };
  // Sends queue behind at most the in-flight window.
  feed.stream = OpenPipe(channel, EncodePipeMessage(open), std::move(callbacks), window_);
}

void Feeds::OnMessage(int replica, const std::string& what, absl::StatusOr<PipeMessage> m) {
  FeedEvent e;
  e.kind = FeedEvent::kError;
  e.replica = replica;
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
  for (Pair& pair : feeds_) {
    for (Feed* f : {&pair.input, &pair.target}) {
      if (!f->stream) continue;
      f->stream->CloseAndWait();  // after it, no event from this feed
      f->stream.reset();
    }
  }
}

namespace {
std::atomic<uint64_t> sent_bytes{0};
}  // namespace

uint64_t Feeds::TotalSentBytes() { return sent_bytes.load(); }

absl::Status Feeds::Send(int replica, const v1::DataSlice& slice, uint64_t id, v1::Phase phase) {
  if (replica < 0 || replica >= static_cast<int>(feeds_.size()) || !feeds_[replica].input.stream ||
      !feeds_[replica].target.stream) {
    return absl::UnavailableError("the feeds are closed");
  }
  Pair& pair = feeds_[replica];
  v1::StageMessage m;
  m.set_microbatch(id);
  m.set_phase(phase);
  *m.mutable_data() = slice;
  // Targets first, so the last stage has them when the activation arrives.
  for (Feed* feed : {&pair.target, &pair.input}) {
    grpc::ByteBuffer encoded = EncodePipeMessage(m);
    sent_bytes += encoded.Length();
    if (!feed->stream->Send(std::move(encoded))) {
      return absl::UnavailableError(absl::StrCat("lost the ", feed->what));
    }
  }
  return absl::OkStatus();
}

}  // namespace pipemare
