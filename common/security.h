// Who may call what, and over which connection: mutual TLS between the
// services, bearer tokens from clients, and one access policy per server that
// checks every call (docs/security.md).
//
// Identities. A coordinator or worker proves who it is with a certificate
// signed by the cluster CA; the certificate's common name says its role
// (kCoordinatorName or kWorkerName) and its subject alternative names the
// hosts it may serve on. A client (pipemarectl) proves who it is with a
// bearer token whose role is `read` (status, list, watch, workers) or
// `submit` (read plus submit, cancel, resume, export).
#ifndef PIPEMARE_COMMON_SECURITY_H_
#define PIPEMARE_COMMON_SECURITY_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_metadata_processor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace CLI {
class App;
}

namespace pipemare {

inline constexpr char kCoordinatorName[] = "pipemare-coordinator";
inline constexpr char kWorkerName[] = "pipemare-worker";

// What a process presents and trusts on its gRPC connections. Set once at
// start-up (SetRpcSecurity); MakeChannel and StartServer (common/rpc.h) use
// it. The default is plaintext, for in-process tests and benchmarks; the
// binaries refuse to run that way without --insecure.
struct RpcSecurity {
  bool insecure = true;
  std::string ca_pem;    // the CA peers must be signed by (a client may leave
                         // it empty to trust the system's roots)
  std::string cert_pem;  // this process's certificate and key (a client
  std::string key_pem;   // with a token needs none)
  std::string token;     // sent as "authorization: Bearer ..." on every call
};

void SetRpcSecurity(RpcSecurity security);
const RpcSecurity& CurrentRpcSecurity();

// What one server may take on at once (flags --max-server-threads,
// --max-concurrent-streams; SetServerLimits in common/rpc.h): threads of the
// synchronous handlers (a call beyond them gets RESOURCE_EXHAUSTED) and
// HTTP/2 streams per connection.
struct ServerLimits {
  int max_threads = 256;
  int max_concurrent_streams = 1024;
};

// Where a process finds its credentials (AddSecurityFlags), and a service's
// server limits.
struct SecurityFlags {
  bool insecure = false;
  std::string ca_file, cert_file, key_file;
  std::string token_file;  // clients: a file holding the token
  std::string token;       // clients: the token itself (PIPEMARE_TOKEN only)
  ServerLimits limits;     // services
};

// Adds --insecure, --tls-ca, --tls-cert and --tls-key (a client: --tls-ca,
// --token-file and no certificate), each also read from its environment
// variable (PIPEMARE_INSECURE, PIPEMARE_TLS_CA, ...; PIPEMARE_TOKEN holds a
// client's token itself: a token is never a flag). A service also gets the
// ServerLimits flags.
void AddSecurityFlags(CLI::App& app, SecurityFlags* flags, bool client);

// Reads and checks the files `flags` names for a process in `role`
// (kCoordinatorName, kWorkerName, or "" for a client): each is a readable PEM
// file, the certificate matches its key, was signed by the CA and names
// `role`. Errors name the flag and the fix.
absl::StatusOr<RpcSecurity> LoadRpcSecurity(const SecurityFlags& flags, const std::string& role);

// A bearer token a coordinator accepts (from its --tokens-file).
struct TokenEntry {
  std::string name;  // who: recorded on the jobs it submits
  std::string role;  // "read" or "submit"
  std::string token;
};

// Parses a tokens file: one `NAME ROLE TOKEN` per line, `#` comments. Names
// and tokens unique, roles read|submit, tokens at least 16 characters of
// printable ASCII. Errors name the file and the line.
absl::StatusOr<std::vector<TokenEntry>> LoadTokens(const std::string& path);

// Reads a client's token from a file: its one line, trimmed.
absl::StatusOr<std::string> LoadToken(const std::string& path, const std::string& flag);

// What a method needs: any of these callers may call it.
enum Caller : unsigned {
  kReader = 1,       // a token with role read or submit
  kSubmitter = 2,    // a token with role submit
  kWorker = 4,       // a certificate named kWorkerName
  kCoordinator = 8,  // a certificate named kCoordinatorName
};

// The one check of every call on a TLS server: finds the method's rule
// (a method not in `rules` is refused), establishes the caller from its
// certificate and its bearer token, and refuses with UNAUTHENTICATED (no
// valid credential) or PERMISSION_DENIED (a valid one without the rule's
// role). A server with no tokens (a worker) ignores one. Tokens are compared in constant time;
// handlers learn the caller's name from CallerName(), never the token. Nothing is added to the
// auth context: gRPC shares it between every call of a connection.
class AccessPolicy : public grpc::AuthMetadataProcessor {
 public:
  AccessPolicy(std::map<std::string, unsigned> rules, std::vector<TokenEntry> tokens);
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override;

 private:
  std::map<std::string, unsigned> rules_;
  std::vector<TokenEntry> tokens_;
};

// The caller of a call that passed an AccessPolicy: its bearer token's
// holder, else its certificate's common name ("anonymous" on a plaintext
// server).
std::string CallerName(const grpc::ServerContextBase& context);

// Whether a certificate's subject alternative name `name` covers `host`:
// equal (DNS names compared without case), or a wildcard `*.rest` that
// stands for exactly one leftmost DNS label, as TLS clients (and gRPC's own
// check) read it (RFC 6125 6.4.3); `rest` must hold a dot, so `*.com` covers
// nothing. One certificate naming `*.pipemare-worker.NS.svc` then serves every
// replica of a Kubernetes StatefulSet (deploy/k8s).
bool CertificateNameCovers(const std::string& name, const std::string& host);

// Whether `host` is an IPv4 or IPv6 address (not a DNS name).
bool IsIpAddress(const std::string& host);

// The host names and IP addresses a PEM certificate's subject alternative
// names hold (empty when it cannot be read).
std::vector<std::string> CertificateHosts(const std::string& cert_pem);

// The host a worker bound to every interface advertises: `local_ip` (the
// address it uses toward the coordinator) when its certificate names it or
// there is no certificate, else the first name of `certificate_hosts` that
// is this host's name (`hostname`) or resolves to `local_ip`. Empty when no
// name the certificate holds fits: the coordinator would refuse any.
std::string AdvertisedHost(const std::string& local_ip,
                           const std::vector<std::string>& certificate_hosts,
                           const std::string& hostname);

// On a TLS server, OK only if the caller's certificate names the host of
// `address` ("host:port") among its subject alternative names
// (CertificateNameCovers): a worker may register only an address it holds a
// certificate for. OK on a plaintext server.
absl::Status CheckCertificateNamesAddress(const grpc::ServerContext& context,
                                          const std::string& address);

// Server credentials for the current RpcSecurity: TLS with the process's
// certificate, asking for a client certificate signed by the CA (required
// when `require_client_certificate`, else verified if presented) and
// checking every call with `policy`; plaintext when insecure.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(std::shared_ptr<AccessPolicy> policy,
                                                               bool require_client_certificate);
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials();

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_SECURITY_H_
