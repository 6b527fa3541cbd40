// The one module through which every gRPC server and channel is created, so
// that message limits, keepalives and (later) credentials are set in one place.
#ifndef PIPEMARE_COMMON_RPC_H_
#define PIPEMARE_COMMON_RPC_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/security.h"

namespace pipemare {

// Largest message either side accepts: one microbatch of activations.
inline constexpr int kMaxMessageBytes = 256 * 1024 * 1024;

// A channel to `address` ("host:port") with Pipemare's limits and keepalives
// (ChannelArgs()), over TLS with this process's certificate and token when
// the process has them (CurrentRpcSecurity()).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);
grpc::ChannelArguments ChannelArgs();

// Starts a server for `service` on `address` ("host:port"; port 0 picks a
// free one) with Pipemare's limits and keepalives. Over TLS (the process's
// RpcSecurity), `policy` checks every call and a client certificate is
// required when `require_client_certificate` (MakeServerCredentials).
// Returns the server and sets `*port` to the bound port, or an error naming
// `flag` (e.g. "--listen") when the address cannot be bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    const std::string& address, grpc::Service* service, int* port, const std::string& flag,
    std::shared_ptr<AccessPolicy> policy = nullptr, bool require_client_certificate = true);

// The one way a gRPC server in Pipemare binds its port: `address` with
// `credentials`, SO_REUSEPORT off (gRPC turns it on by default, which lets a
// second process bind a port that is already serving and take half its
// calls). After BuildAndStart, `*port` is the bound port or 0.
void ListenExclusively(grpc::ServerBuilder& builder, const std::string& address,
                       std::shared_ptr<grpc::ServerCredentials> credentials, int* port);

// The error for a server that could not bind `address` (the flag that set it
// named): whether the port is taken by another process or the address is
// not host:port, and what to change.
absl::Status CannotListen(const std::string& flag, const std::string& address);

// What each server may take on at once (ServerLimits, common/security.h).
void SetServerLimits(ServerLimits limits);

// Pipemare's server limits and keepalives on `builder` (what StartServer
// uses; for servers built elsewhere, such as bench_transport's bare one).
void ApplyServerOptions(grpc::ServerBuilder& builder);

// A client context with a deadline `seconds` from now.
std::unique_ptr<grpc::ClientContext> ContextWithDeadline(double seconds);

// Status conversion, only at handler and client edges.
grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);

// Keeps freed message-sized buffers in the process's heap instead of
// returning them to the kernel, so that the next message of the same size
// reuses warm pages rather than page-faulting in fresh ones. Each message
// allocates payload-sized buffers (the proto's bytes, gRPC's slices); with
// glibc's defaults every buffer over 128 KiB is a fresh mmap. Measured by
// bench/transport.cc (--malloc default|tuned). Call once, at start-up.
void TuneMallocForLargeMessages();

// Replaces the port in "host:port" by `port`.
std::string WithPort(const std::string& address, int port);

// The local IP address this host uses to reach `address` ("host:port"): the
// source address the kernel picks for a route to it (a UDP socket connected
// there; nothing is sent). How a process bound to 0.0.0.0 names itself to a
// peer without trusting its hostname. UNAVAILABLE naming `address` when it
// does not resolve or has no route.
absl::StatusOr<std::string> LocalAddressToward(const std::string& address);

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_RPC_H_
