// Health for probes: gRPC's standard health service (grpc.health.v1.Health,
// gRPC's own implementation, EnableDefaultHealthCheckService) on a
// plaintext port of its own, as /metrics has. A probe (Kubernetes' native
// `grpc:` probe, Docker's HEALTHCHECK through `pipemarectl health`) carries
// no client certificate, and the service ports require one; this port
// serves nothing but the health service, which says only SERVING or
// NOT_SERVING (docs/security.md).
//
// Two names answer: "" (liveness) is SERVING while the process serves, and
// the service's own name (readiness: "pipemare.v1.Coordinator" once its
// state is loaded, "pipemare.v1.StageWorker" while registered with a
// coordinator) is SERVING only when Ready(true).
#ifndef PIPEMARE_COMMON_HEALTH_H_
#define PIPEMARE_COMMON_HEALTH_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace pipemare {

inline constexpr char kCoordinatorServiceName[] = "pipemare.v1.Coordinator";
inline constexpr char kWorkerServiceName[] = "pipemare.v1.StageWorker";

class HealthServer {
 public:
  // Serves on `listen` (host:port, port 0 = any) with `service` NOT_SERVING.
  // An error names `flag` when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HealthServer>> Start(const std::string& listen,
                                                             const std::string& service,
                                                             const std::string& flag);
  ~HealthServer();
  HealthServer(const HealthServer&) = delete;
  HealthServer& operator=(const HealthServer&) = delete;

  // Readiness: `service` SERVING or NOT_SERVING (liveness stays SERVING).
  void Ready(bool ready);
  // host:port it is bound to (the listen host with the bound port).
  const std::string& address() const { return address_; }

 private:
  HealthServer() = default;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::unique_ptr<grpc::Server> server_;
  std::string service_, address_;
};

// A probe's view: the status `service` has at `address` (plaintext), within
// `deadline_seconds`; UNAVAILABLE and friends when the call fails.
absl::StatusOr<bool> CheckServing(const std::string& address, const std::string& service,
                                  double deadline_seconds);

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_HEALTH_H_
