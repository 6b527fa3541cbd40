#include "common/rpc.h"

#include <arpa/inet.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>

#include "absl/strings/str_cat.h"

namespace pipemare {

namespace {
void SetKeepalive(grpc::ChannelArguments& args) {
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}
}  // namespace

void TuneMallocForLargeMessages() {
  // 32 MiB is the largest mmap threshold mallopt accepts on 64-bit glibc;
  // setting it also turns off glibc's dynamic threshold. Trimming only past
  // 1 GiB of free heap keeps the pages of recent messages mapped.
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);
}

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  SetKeepalive(args);
  // Reconnect quickly after a peer restarts.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  return args;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  return grpc::CreateCustomChannel(address, MakeChannelCredentials(), ChannelArgs());
}

namespace {
ServerLimits& Limits() {
  static ServerLimits limits;
  return limits;
}
}  // namespace

void SetServerLimits(ServerLimits limits) { Limits() = limits; }

void ApplyServerOptions(grpc::ServerBuilder& builder) {
  grpc::ResourceQuota quota("pipemare-server");
  quota.SetMaxThreads(Limits().max_threads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, Limits().max_concurrent_streams);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Our clients ping every 10 s even while only they send (a stage's
  // stream to a paused neighbour): the server must not count that as abuse
  // and end the connection.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(const std::string& address,
                                                          grpc::Service* service, int* port,
                                                          const std::string& flag,
                                                          std::shared_ptr<AccessPolicy> policy,
                                                          bool require_client_certificate) {
  if (!CurrentRpcSecurity().insecure && !policy) {
    return absl::InternalError(absl::StrCat(flag, ": a TLS server needs an access policy"));
  }
  grpc::ServerBuilder builder;
  ListenExclusively(builder, address,
                    MakeServerCredentials(std::move(policy), require_client_certificate), port);
  builder.RegisterService(service);
  ApplyServerOptions(builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) return CannotListen(flag, address);
  return server;
}

void ListenExclusively(grpc::ServerBuilder& builder, const std::string& address,
                       std::shared_ptr<grpc::ServerCredentials> credentials, int* port) {
  *port = 0;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, std::move(credentials), port);
}

absl::Status CannotListen(const std::string& flag, const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " '", address, "': not host:port (e.g. 0.0.0.0:7070)"));
  }
  const std::string port = address.substr(colon + 1);
  return absl::FailedPreconditionError(absl::StrCat(
      flag, " ", address, ": cannot listen there: port ", port,
      " is taken by another process (is one already running? stop it, or give this one another "
      "port with ",
      flag, ") or the host is not an address of this machine"));
}

std::unique_ptr<grpc::ClientContext> ContextWithDeadline(double seconds) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  return context;
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    message = absl::StrCat("unavailable: ", message);
  } else if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    message = absl::StrCat("timed out: ", message);
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), message);
}

absl::StatusOr<std::string> LocalAddressToward(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", address, ": ", gai_strerror(rc)));
  }
  absl::Status last = absl::UnavailableError(absl::StrCat("no address for ", address));
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {0};
    const bool ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
    close(fd);
    if (!ok) {
      last = absl::UnavailableError(absl::StrCat("no route to ", address));
      continue;
    }
    if (local.ss_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&local)->sin_addr, text, sizeof(text));
      freeaddrinfo(found);
      return std::string(text);
    }
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr, text, sizeof(text));
    freeaddrinfo(found);
    return absl::StrCat("[", text, "]");
  }
  freeaddrinfo(found);
  return last;
}

std::string WithPort(const std::string& address, int port) {
  auto colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  return absl::StrCat(host, ":", port);
}

}  // namespace pipemare
