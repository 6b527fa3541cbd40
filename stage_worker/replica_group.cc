#include "stage_worker/replica_group.h"

#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/str_cat.h"

namespace pipemare {
namespace {

// "host" and port of "host:port" or "[v6]:port".
bool SplitAddress(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  try {
    *port = std::stoi(address.substr(colon + 1));
  } catch (const std::exception&) {
    return false;
  }
  return !host->empty() && *port > 0 && *port < 65536;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ReplicaGroup>> ReplicaGroup::Create(
    const v1::StageAssignment& a, const std::string& self_address) {
  if (a.replicas() <= 1) return std::unique_ptr<ReplicaGroup>();
  std::string bind_host;
  int self_port = 0;
  if (!SplitAddress(self_address, &bind_host, &self_port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the worker's address '", self_address, "' is not host:port"));
  }
  if (a.replica() < 0 || a.replica() >= a.replicas()) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica: ", a.replica(), " is not in 0..replicas - 1 (", a.replicas(), ")"));
  }
  std::unique_ptr<ReplicaGroup> g(new ReplicaGroup());
  g->rank_ = a.replica();
  g->size_ = a.replicas();
  g->bind_host_ = bind_host;
  c10d::TCPStoreOptions o;
  o.numWorkers = static_cast<size_t>(a.replicas());
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(60);
  std::string host = bind_host;
  try {
    if (a.replica() == 0) {
      o.isServer = true;
      o.port = 0;  // any free port
      auto store = c10::make_intrusive<c10d::TCPStore>(host, o);
      g->address_ =
          absl::StrCat(host.find(':') != std::string::npos ? "[" : "", host,
                       host.find(':') != std::string::npos ? "]" : "", ":", store->getPort());
      g->store_ = store;
    } else {
      int port = 0;
      if (!SplitAddress(a.collective_address(), &host, &port)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "collective_address: '", a.collective_address(),
            "' is not host:port (replica 0's stage gives it; the coordinator passes it on)"));
      }
      o.port = static_cast<uint16_t>(port);
      g->store_ = c10::make_intrusive<c10d::TCPStore>(host, o);
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("the all-reduce store of replica ", a.replica(), ": ", e.what()));
  }
  return g;
}

ReplicaGroup::~ReplicaGroup() {
  // ProcessGroupGloo's destructor waits for its queued collectives: one
  // abandoned by Abort() may wait for the group's timeout. Not here.
  if (aborted_ && group_) {
    std::thread([group = std::move(group_), store = std::move(store_)]() mutable {
      group.reset();
      store.reset();
    }).detach();
  }
}

std::string ReplicaGroup::Address() const { return address_; }

absl::Status ReplicaGroup::Connect(std::chrono::milliseconds timeout) {
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_host_));
    options->threads = 1;
    group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank_, size_, options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("replica ", rank_, " of ", size_,
                     " could not join its stage's all-reduce group: ", e.what()));
  }
  return absl::OkStatus();
}

void ReplicaGroup::Average(const std::vector<torch::Tensor>& grads) {
  if (grads.empty()) return;
  const auto start = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat_parts;
  for (const auto& g : grads) flat_parts.push_back(g.reshape({-1}));
  std::vector<torch::Tensor> flat = {torch::cat(flat_parts)};
  auto work = group_->allreduce(flat);
  while (!work->isCompleted()) {
    if (aborted_) throw std::runtime_error("the stage stops; its all-reduce is abandoned");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  work->wait();  // rethrows the collective's error
  flat[0].div_(size_);
  int64_t offset = 0;
  for (const auto& g : grads) {
    const int64_t n = g.numel();
    g.copy_(flat[0].narrow(0, offset, n).view_as(g));
    offset += n;
  }
  ++allreduces_;
  bytes_ += static_cast<int64_t>(flat[0].nbytes());
  seconds_ = seconds_.load() +
             std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace pipemare
