// The one place where a service's Prometheus /metrics endpoint is served:
// prometheus-cpp collects and serialises, cpp-httplib serves HTTP. (Not
// prometheus-cpp's civetweb exposer: Debian's civetweb refuses to start in a
// process that has OpenSSL 3 loaded, as every LibTorch process does.)
// Metric names and their meaning are in docs/observability.md.
#ifndef PIPEMARE_COMMON_METRICS_H_
#define PIPEMARE_COMMON_METRICS_H_

#include <prometheus/collectable.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace pipemare {

class MetricsServer {
 public:
  // Serves `collectables` on http://`address`/metrics. `address` is
  // host:port (port 0 = any free port); errors name `flag`.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::vector<std::weak_ptr<prometheus::Collectable>> c,
      const std::string& flag = "--metrics-listen");
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // host:port actually bound.
  const std::string& address() const { return address_; }

 private:
  MetricsServer() = default;
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  std::string address_;
};

// Prometheus file-based service discovery (file_sd_configs) for one
// coordinator and its workers, each host:port labelled service=coordinator or
// service=worker; an empty coordinator address is left out.
std::string FileSdTargets(const std::string& coordinator, const std::vector<std::string>& workers);

// Writes FileSdTargets() to `path` atomically (write, then rename), so a
// Prometheus watching the file never reads half of it.
absl::Status WriteFileSdTargets(const std::string& path, const std::string& coordinator,
                                const std::vector<std::string>& workers);

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_METRICS_H_
