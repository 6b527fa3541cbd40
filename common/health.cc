#include "common/health.h"

#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace pipemare {

absl::StatusOr<std::unique_ptr<HealthServer>> HealthServer::Start(const std::string& listen,
                                                                  const std::string& service,
                                                                  const std::string& flag) {
  // gRPC adds its health service to every server built from now on; the
  // service ports' access policies refuse it (only this port answers).
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<HealthServer> h(new HealthServer());
  h->service_ = service;
  int port = 0;
  grpc::ServerBuilder builder;
  ListenExclusively(builder, listen, grpc::InsecureServerCredentials(), &port);
  // A server whose only service is gRPC's (added at start) must be given a
  // completion queue to be built; nothing is queued on it.
  h->cq_ = builder.AddCompletionQueue();
  h->server_ = builder.BuildAndStart();
  if (h->server_ == nullptr || port == 0 || h->server_->GetHealthCheckService() == nullptr) {
    return CannotListen(flag, listen);
  }
  h->address_ = WithPort(listen, port);
  h->Ready(false);
  return h;
}

HealthServer::~HealthServer() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  if (cq_) {
    cq_->Shutdown();
    void* tag;
    bool ok;
    while (cq_->Next(&tag, &ok)) {
    }
  }
}

void HealthServer::Ready(bool ready) {
  server_->GetHealthCheckService()->SetServingStatus(service_, ready);
}

absl::StatusOr<bool> CheckServing(const std::string& address, const std::string& service,
                                  double deadline_seconds) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  auto ctx = ContextWithDeadline(deadline_seconds);
  grpc::Status st = stub->Check(ctx.get(), req, &resp);
  if (!st.ok()) return FromGrpc(st);
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace pipemare
