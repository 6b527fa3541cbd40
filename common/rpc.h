// The one module through which every gRPC server and channel is created, so
// that message limits, keepalives and (later) credentials are set in one place.
#ifndef PIPEMARE_COMMON_RPC_H_
#define PIPEMARE_COMMON_RPC_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"

namespace pipemare {

// Largest message either side accepts: one microbatch of activations.
inline constexpr int kMaxMessageBytes = 256 * 1024 * 1024;

// A channel to `address` ("host:port") with Pipemare's limits and keepalives.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);

// Configures `builder` to listen on `address` with Pipemare's limits and
// keepalives. `*selected_port` receives the bound port after BuildAndStart()
// (so "127.0.0.1:0" picks a free one).
void ConfigureServer(grpc::ServerBuilder& builder, const std::string& address, int* selected_port);

// A client context with a deadline `seconds` from now.
std::unique_ptr<grpc::ClientContext> ContextWithDeadline(double seconds);

// Status conversion, only at handler and client edges.
grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);

// Replaces the port in "host:port" by `port`.
std::string WithPort(const std::string& address, int port);

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_RPC_H_
