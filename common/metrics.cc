#include "common/metrics.h"

#include <httplib.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rpc.h"

namespace pipemare {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::vector<std::weak_ptr<prometheus::Collectable>> c,
    const std::string& flag) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size() ||
      address.size() - colon > 6 ||
      address.find_first_not_of("0123456789", colon + 1) != std::string::npos ||
      std::stoi(address.substr(colon + 1)) > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", address, ": expected host:port, e.g. 0.0.0.0:9460 (port 0 = any)"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const int port = std::stoi(address.substr(colon + 1));
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->collectables_ = std::move(c);
  server->http_ = std::make_unique<httplib::Server>();
  server->http_->new_task_queue = [] { return new httplib::ThreadPool(2); };
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which lets a
  // second process bind a port that is already serving.
  server->http_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  MetricsServer* self = server.get();
  server->http_->Get("/metrics", [self](const httplib::Request&, httplib::Response& res) {
    std::vector<prometheus::MetricFamily> families;
    for (const auto& weak : self->collectables_) {
      if (auto collectable = weak.lock()) {
        auto f = collectable->Collect();
        families.insert(families.end(), std::make_move_iterator(f.begin()),
                        std::make_move_iterator(f.end()));
      }
    }
    res.set_content(prometheus::TextSerializer().Serialize(families),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  int bound = port;
  if (port == 0) {
    bound = server->http_->bind_to_any_port(host);
  } else if (!server->http_->bind_to_port(host, port)) {
    bound = -1;
  }
  if (bound <= 0) {
    return CannotListen(flag, address);
  }
  server->address_ = WithPort(address, bound);
  server->thread_ = std::thread([self] { self->http_->listen_after_bind(); });
  // Serving once Start returns; and httplib's stop() is a no-op until the
  // server runs, so the destructor must not race the listening thread.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!server->http_->is_running()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::UnavailableError(
          absl::StrCat(flag, " ", address, ": the HTTP server did not start"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return server;
}

std::string FileSdTargets(const std::string& coordinator, const std::vector<std::string>& workers) {
  auto group = [](const std::vector<std::string>& targets, const char* service) {
    return absl::StrCat("{\"targets\": [\"", absl::StrJoin(targets, "\", \""),
                        "\"], \"labels\": {\"service\": \"", service, "\"}}");
  };
  std::vector<std::string> groups;
  if (!coordinator.empty()) groups.push_back(group({coordinator}, "coordinator"));
  if (!workers.empty()) groups.push_back(group(workers, "worker"));
  return absl::StrCat("[", absl::StrJoin(groups, ",\n "), "]\n");
}

absl::Status WriteFileSdTargets(const std::string& path, const std::string& coordinator,
                                const std::vector<std::string>& workers) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << FileSdTargets(coordinator, workers);
    if (!out.flush()) {
      return absl::UnavailableError(
          absl::StrCat("cannot write ", tmp, ": check that its directory exists and is writable"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

MetricsServer::~MetricsServer() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace pipemare
