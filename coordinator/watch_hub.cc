#include "coordinator/watch_hub.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/security.h"
#include "common/thread_name.h"

namespace pipemare {

class WatchHub::Watcher : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  Watcher(WatchHub* hub, std::string job, std::string caller)
      : hub_(hub), job(std::move(job)), caller(std::move(caller)) {}
  void OnWriteDone(bool ok) override { hub_->WriteDone(this, ok); }
  void OnCancel() override { hub_->Cancelled(this); }
  void OnDone() override {
    hub_->Done(this);
    delete this;
  }

 private:
  WatchHub* const hub_;

 public:
  // The hub's, under its mu_.
  const std::string job, caller;
  bool counted = false;    // in watchers_ and per_caller_
  uint64_t sent = 0;       // the newest version written
  bool writing = false;    // a write is in flight: the only op until it is done
  bool finishing = false;  // Finish was decided: nothing after it
  bool cancelled = false;  // the caller went away
  bool terminal_sent = false;
  std::shared_ptr<const v1::JobEvent> in_flight;  // alive while written
};

WatchHub::WatchHub(const JobStore* store, size_t max_per_caller)
    : store_(store), max_per_caller_(max_per_caller) {
  thread_ = std::thread([this] { Loop(); });
}

WatchHub::~WatchHub() { Stop(); }

size_t WatchHub::watchers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return watchers_.size();
}

grpc::ServerWriteReactor<v1::JobEvent>* WatchHub::Watch(grpc::CallbackServerContext* context,
                                                        const v1::WatchJobRequest* request) {
  auto* w = new Watcher(this, request->id(), CallerName(*context));
  Step step;
  step.watcher = w;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_ && per_caller_[w->caller] >= max_per_caller_) {
      w->finishing = true;
      step.finish = true;
      step.status = grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat(w->caller, " has ", max_per_caller_,
                       " watches open, the most one caller may (--max-watches-per-caller); close "
                       "some, or poll with pipemarectl status"));
    } else {
      watchers_.insert(w);
      w->counted = true;
      ++per_caller_[w->caller];
      step = NextStepLocked(w);
    }
  }
  Do(step);
  return w;
}

WatchHub::Step WatchHub::NextStepLocked(Watcher* w) {
  Step s;
  s.watcher = w;
  if (w->writing || w->finishing) return s;
  auto finish = [&](grpc::Status status) {
    w->finishing = true;
    s.finish = true;
    s.status = std::move(status);
    return s;
  };
  if (stop_) {
    return finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "the coordinator is stopping; watch again once it is back"));
  }
  if (w->cancelled) return finish(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
  if (w->terminal_sent) return finish(grpc::Status::OK);  // the job ended
  std::shared_ptr<const v1::JobEvent> event;
  bool terminal = false;
  const uint64_t version = EventLocked(w->job, &event, &terminal);
  if (version == 0) {
    return finish(grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("no job '", w->job, "'")));
  }
  if (version <= w->sent) return s;  // nothing new
  w->sent = version;
  w->writing = true;
  w->terminal_sent = terminal;
  w->in_flight = event;
  s.write = std::move(event);
  return s;
}

uint64_t WatchHub::EventLocked(const std::string& id, std::shared_ptr<const v1::JobEvent>* event,
                               bool* terminal) {
  Cached& c = cache_[id];
  v1::JobStatus status;
  const uint64_t version = store_->VersionIfNewer(id, c.version, &status);
  if (version == 0) {
    cache_.erase(id);
    return 0;
  }
  if (version > c.version) {
    auto e = std::make_shared<v1::JobEvent>();
    *e->mutable_job() = std::move(status);
    c.terminal = IsTerminal(e->job().state());
    c.event = std::move(e);
    c.version = version;
  }
  *event = c.event;
  *terminal = c.terminal;
  return c.version;
}

void WatchHub::Do(const Step& step) {
  // Outside mu_: a reaction may run on another thread at once.
  if (step.write) {
    step.watcher->StartWrite(step.write.get());
  } else if (step.finish) {
    step.watcher->Finish(step.status);
  }
}

void WatchHub::WriteDone(Watcher* w, bool ok) {
  Step step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w->writing = false;
    w->in_flight.reset();
    if (!ok) w->cancelled = true;  // the watcher went away
    step = NextStepLocked(w);
  }
  Do(step);
}

void WatchHub::Cancelled(Watcher* w) {
  Step step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w->cancelled = true;
    step = NextStepLocked(w);
  }
  Do(step);
}

void WatchHub::Done(Watcher* w) {
  std::lock_guard<std::mutex> lock(mu_);
  if (w->counted) {
    watchers_.erase(w);
    if (--per_caller_[w->caller] == 0) per_caller_.erase(w->caller);
  }
  cv_.notify_all();
}

void WatchHub::Loop() {
  NameThisThread("watch-hub");
  uint64_t seen = 0;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    seen = store_->WaitForAnyChange(seen, std::chrono::milliseconds(500));
    std::vector<Step> steps;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      for (Watcher* w : watchers_) {
        Step s = NextStepLocked(w);
        if (s.write || s.finish) steps.push_back(std::move(s));
      }
      // Jobs no one watches leave the cache.
      for (auto it = cache_.begin(); it != cache_.end();) {
        bool watched = false;
        for (Watcher* w : watchers_) watched = watched || w->job == it->first;
        it = watched ? std::next(it) : cache_.erase(it);
      }
    }
    for (const Step& s : steps) Do(s);
  }
}

void WatchHub::Stop() {
  std::vector<Step> steps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (Watcher* w : watchers_) {
      Step s = NextStepLocked(w);
      if (s.finish) steps.push_back(std::move(s));
    }
  }
  for (const Step& s : steps) Do(s);
  if (thread_.joinable()) thread_.join();
  // A watch still writing finishes when its write is done; its reactor
  // calls back into the hub until then.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::seconds(10), [&] { return watchers_.empty(); });
}

}  // namespace pipemare
