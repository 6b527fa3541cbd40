#include "common/security.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace pipemare {

namespace {

std::mutex security_mu;
RpcSecurity& Security() {
  static RpcSecurity* security = new RpcSecurity();
  return *security;
}

// Credential files are small; anything larger is not one.
constexpr size_t kMaxCredentialFileBytes = 1 << 20;

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const std::string& flag) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": not a readable regular file"));
  }
  if (std::filesystem::file_size(path, ec) > kMaxCredentialFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": larger than 1 MiB"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    // Most often the permissions: a key readable by root only, a service
    // running as another user (the images run as uid 10001).
    const int err = errno;
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": cannot be read (", std::strerror(err), ", as uid ",
                     getuid(), "): make it readable by the user this service runs as"));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot be read"));
  }
  return text.str();
}

struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyDeleter>;

X509Ptr ParseCertificate(const std::string& pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(pem.data(), pem.size()), BIO_free);
  return X509Ptr(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

KeyPtr ParseKey(const std::string& pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(pem.data(), pem.size()), BIO_free);
  return KeyPtr(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
}

std::string CommonName(X509* cert) {
  char name[256] = {0};
  X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, name, sizeof(name) - 1);
  return name;
}

// Equal in time that depends only on the lengths of what is compared, not
// on where the first difference is.
bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

bool ValidToken(const std::string& token) {
  if (token.size() < 16) return false;
  for (char c : token) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

std::string RoleNeeded(unsigned rule) {
  std::vector<std::string> who;
  if (rule & kReader) {
    who.push_back("a token with role read or submit");
  } else if (rule & kSubmitter) {
    who.push_back("a token with role submit");
  }
  if (rule & kCoordinator) who.push_back("the coordinator's certificate");
  if (rule & kWorker) who.push_back("a worker's certificate");
  return absl::StrJoin(who, " or ");
}

}  // namespace

void SetRpcSecurity(RpcSecurity security) {
  std::lock_guard<std::mutex> lock(security_mu);
  Security() = std::move(security);
}

const RpcSecurity& CurrentRpcSecurity() {
  std::lock_guard<std::mutex> lock(security_mu);
  return Security();
}

void AddSecurityFlags(CLI::App& app, SecurityFlags* flags, bool client) {
  app.add_flag("--insecure", flags->insecure,
               "plaintext gRPC without authentication (only on a network you trust)")
      ->envname("PIPEMARE_INSECURE");
  app.add_option("--tls-ca", flags->ca_file,
                 client ? "PEM file of the CA that signed the coordinator's certificate "
                          "(default: the system's trusted roots)"
                        : "PEM file of the cluster CA that signs every service's certificate")
      ->envname("PIPEMARE_TLS_CA");
  if (client) {
    app.add_option("--token-file", flags->token_file,
                   "file holding this user's bearer token (or the token itself in "
                   "PIPEMARE_TOKEN)")
        ->envname("PIPEMARE_TOKEN_FILE");
    if (const char* token = std::getenv("PIPEMARE_TOKEN"); token != nullptr) {
      flags->token = token;
    }
    return;
  }
  app.add_option("--tls-cert", flags->cert_file,
                 "PEM file of this service's certificate, signed by the cluster CA")
      ->envname("PIPEMARE_TLS_CERT");
  app.add_option("--tls-key", flags->key_file, "PEM file of that certificate's private key")
      ->envname("PIPEMARE_TLS_KEY");
  app.add_option("--max-server-threads", flags->limits.max_threads,
                 "threads serving RPCs at once; calls beyond get RESOURCE_EXHAUSTED")
      ->envname("PIPEMARE_MAX_SERVER_THREADS")
      ->check(CLI::Range(4, 65536))
      ->capture_default_str();
  app.add_option("--max-concurrent-streams", flags->limits.max_concurrent_streams,
                 "HTTP/2 streams one connection may hold open")
      ->envname("PIPEMARE_MAX_CONCURRENT_STREAMS")
      ->check(CLI::Range(8, 1 << 20))
      ->capture_default_str();
}

absl::StatusOr<RpcSecurity> LoadRpcSecurity(const SecurityFlags& flags, const std::string& role) {
  RpcSecurity security;
  const bool service = !role.empty();
  if (flags.insecure) {
    if (!flags.ca_file.empty() || !flags.cert_file.empty() || !flags.key_file.empty()) {
      return absl::InvalidArgumentError(
          "--insecure: plaintext was asked for together with --tls-* files; give one or the "
          "other");
    }
    return security;
  }
  security.insecure = false;
  if (service && (flags.ca_file.empty() || flags.cert_file.empty() || flags.key_file.empty())) {
    return absl::InvalidArgumentError(
        "TLS needs --tls-ca, --tls-cert and --tls-key (PIPEMARE_TLS_CA, ...; "
        "scripts/dev-ca.sh makes a development set), or --insecure for plaintext "
        "without authentication on a network you trust");
  }
  if (!flags.ca_file.empty()) {
    auto ca = ReadSmallFile(flags.ca_file, "--tls-ca");
    if (!ca.ok()) return ca.status();
    if (!ParseCertificate(*ca)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-ca ", flags.ca_file, ": not a PEM certificate"));
    }
    security.ca_pem = *ca;
  }
  if (service) {
    auto cert = ReadSmallFile(flags.cert_file, "--tls-cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadSmallFile(flags.key_file, "--tls-key");
    if (!key.ok()) return key.status();
    X509Ptr x509 = ParseCertificate(*cert);
    if (!x509) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-cert ", flags.cert_file, ": not a PEM certificate"));
    }
    KeyPtr pkey = ParseKey(*key);
    if (!pkey) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-key ", flags.key_file, ": not a PEM private key"));
    }
    if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-key ", flags.key_file, ": is not the key of --tls-cert ", flags.cert_file));
    }
    // --tls-ca may be a bundle (old and new CA while rotating): any signer.
    bool signed_by_ca = false;
    std::unique_ptr<BIO, decltype(&BIO_free)> bundle(
        BIO_new_mem_buf(security.ca_pem.data(), security.ca_pem.size()), BIO_free);
    while (X509Ptr ca{PEM_read_bio_X509(bundle.get(), nullptr, nullptr, nullptr)}) {
      KeyPtr ca_key(X509_get_pubkey(ca.get()));
      if (ca_key && X509_verify(x509.get(), ca_key.get()) == 1) signed_by_ca = true;
    }
    ERR_clear_error();  // the read past the bundle's last certificate
    if (!signed_by_ca) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert ", flags.cert_file, ": not signed by the CA in --tls-ca ", flags.ca_file));
    }
    if (CommonName(x509.get()) != role) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert ", flags.cert_file, ": its common name is '", CommonName(x509.get()), "'; a ",
          role == kCoordinatorName ? "coordinator" : "worker", " needs a certificate named '", role,
          "' (scripts/dev-ca.sh issues one)"));
    }
    security.cert_pem = *cert;
    security.key_pem = *key;
    return security;
  }
  if (!flags.token_file.empty() && !flags.token.empty()) {
    return absl::InvalidArgumentError(
        "PIPEMARE_TOKEN and --token-file (PIPEMARE_TOKEN_FILE) are both set and only one token "
        "is sent: unset one of them");
  }
  if (!flags.token_file.empty()) {
    auto token = LoadToken(flags.token_file, "--token-file");
    if (!token.ok()) return token.status();
    security.token = *token;
  } else if (!flags.token.empty()) {
    if (!ValidToken(flags.token)) {
      return absl::InvalidArgumentError(
          "PIPEMARE_TOKEN: a token is at least 16 printable characters without spaces");
    }
    security.token = flags.token;
  }
  return security;
}

absl::StatusOr<std::string> LoadToken(const std::string& path, const std::string& flag) {
  auto text = ReadSmallFile(path, flag);
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (!ValidToken(token)) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", path, ": holds no token (one line of at least 16 printable characters)"));
  }
  return token;
}

absl::StatusOr<std::vector<TokenEntry>> LoadTokens(const std::string& path) {
  auto text = ReadSmallFile(path, "--tokens-file");
  if (!text.ok()) return text.status();
  std::vector<TokenEntry> tokens;
  std::set<std::string> names, values;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<std::string> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat("--tokens-file ", path, " line ", line_number);
    if (fields.size() != 3) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected NAME ROLE TOKEN, found ", fields.size(), " fields"));
    }
    TokenEntry entry{fields[0], fields[1], fields[2]};
    if (entry.role != "read" && entry.role != "submit") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": role '", entry.role, "' is neither read nor submit"));
    }
    if (!ValidToken(entry.token)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token of ", entry.name,
                       " is shorter than 16 characters or not printable ASCII (openssl rand -hex "
                       "24 makes one)"));
    }
    if (!names.insert(entry.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": name ", entry.name, " repeats"));
    }
    if (!values.insert(entry.token).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token of ", entry.name, " is also another name's"));
    }
    tokens.push_back(std::move(entry));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens-file ", path, ": no tokens (lines of NAME ROLE TOKEN)"));
  }
  return tokens;
}

namespace {

// The holder of bearer token `header` ("Bearer <token>") among `tokens`, or
// null. Every entry is compared, in constant time.
const TokenEntry* MatchBearer(const std::vector<TokenEntry>& tokens, absl::string_view header) {
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(header, kBearer)) return nullptr;
  const std::string token(header.substr(kBearer.size()));
  const TokenEntry* match = nullptr;
  for (const TokenEntry& entry : tokens) {  // all compared, none skipped
    if (ConstantTimeEquals(entry.token, token)) match = &entry;
  }
  return match;
}

// The tokens of this process's access policies, for CallerName. The
// policy cannot hand a call its caller through the auth context: that
// context is the connection's, shared by every call on it (gRPC's server
// auth filter), so adding to it per call raced between concurrent calls
// and crashed the coordinator under 1000 concurrent watches.
struct KnownTokens {
  std::mutex mu;
  std::vector<TokenEntry> tokens;
};
KnownTokens& Known() {
  static KnownTokens* known = new KnownTokens;
  return *known;
}

}  // namespace

AccessPolicy::AccessPolicy(std::map<std::string, unsigned> rules, std::vector<TokenEntry> tokens)
    : rules_(std::move(rules)), tokens_(std::move(tokens)) {
  std::lock_guard<std::mutex> lock(Known().mu);
  Known().tokens.insert(Known().tokens.end(), tokens_.begin(), tokens_.end());
}

grpc::Status AccessPolicy::Process(const InputMetadata& metadata, grpc::AuthContext* context,
                                   OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) {
  std::string method;
  if (auto path = metadata.find(":path"); path != metadata.end()) {
    method.assign(path->second.data(), path->second.size());
  }
  const auto rule = rules_.find(method);
  if (rule == rules_.end()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("method ", method, " is not served here"));
  }
  unsigned granted = 0;
  std::string caller;
  for (const auto& name : context->FindPropertyValues("x509_common_name")) {
    const std::string cn(name.data(), name.size());
    if (cn == kCoordinatorName) granted |= kCoordinator;
    if (cn == kWorkerName) granted |= kWorker;
    caller = cn;
  }
  // A server without tokens (a worker) grants nothing for one, and ignores it.
  if (auto auth = metadata.find("authorization"); auth != metadata.end() && !tokens_.empty()) {
    const TokenEntry* match =
        MatchBearer(tokens_, absl::string_view(auth->second.data(), auth->second.size()));
    if (match == nullptr) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "the bearer token is not one this coordinator accepts (check "
                          "PIPEMARE_TOKEN or --token-file)");
    }
    granted |= match->role == "submit" ? (kReader | kSubmitter) : kReader;
    caller = match->name;
  }
  if ((granted & rule->second) == 0) {
    if (granted == 0) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat(method, " needs ", RoleNeeded(rule->second),
                                       "; this call has none (give PIPEMARE_TOKEN or "
                                       "--token-file)"));
    }
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrCat(caller, " may not call ", method, ": it needs ", RoleNeeded(rule->second)));
  }
  return grpc::Status::OK;
}

std::string CallerName(const grpc::ServerContextBase& context) {
  // As Process found it: the token's holder, else the certificate's name.
  const auto& metadata = context.client_metadata();
  if (auto auth = metadata.find("authorization"); auth != metadata.end()) {
    std::lock_guard<std::mutex> lock(Known().mu);
    if (const TokenEntry* match = MatchBearer(
            Known().tokens, absl::string_view(auth->second.data(), auth->second.size()))) {
      return match->name;
    }
  }
  if (auto auth = context.auth_context()) {
    for (const auto& name : auth->FindPropertyValues("x509_common_name")) {
      return std::string(name.data(), name.size());
    }
  }
  return "anonymous";
}

bool IsIpAddress(const std::string& host) {
  unsigned char buffer[16];
  return inet_pton(AF_INET, host.c_str(), buffer) == 1 ||
         inet_pton(AF_INET6, host.c_str(), buffer) == 1;
}

bool CertificateNameCovers(const std::string& name, const std::string& host) {
  if (absl::EqualsIgnoreCase(name, host)) return true;
  if (!absl::StartsWith(name, "*.")) return false;
  const std::string rest = name.substr(2);
  const size_t dot = host.find('.');
  if (rest.find('.') == std::string::npos || dot == 0 || dot == std::string::npos) return false;
  if (IsIpAddress(host)) return false;  // an IP address is never covered by a wildcard
  return absl::EqualsIgnoreCase(host.substr(dot + 1), rest);
}

std::vector<std::string> CertificateHosts(const std::string& cert_pem) {
  std::vector<std::string> hosts;
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())), BIO_free);
  if (!bio) return hosts;
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr), X509_free);
  if (!cert) return hosts;
  auto* names = static_cast<GENERAL_NAMES*>(
      X509_get_ext_d2i(cert.get(), NID_subject_alt_name, nullptr, nullptr));
  if (names == nullptr) return hosts;
  for (int i = 0; i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
    if (name->type == GEN_DNS) {
      const ASN1_IA5STRING* dns = name->d.dNSName;
      hosts.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(dns)),
                         ASN1_STRING_length(dns));
    } else if (name->type == GEN_IPADD) {
      const ASN1_OCTET_STRING* ip = name->d.iPAddress;
      char text[INET6_ADDRSTRLEN] = {};
      const int family = ASN1_STRING_length(ip) == 4 ? AF_INET : AF_INET6;
      if (inet_ntop(family, ASN1_STRING_get0_data(ip), text, sizeof(text)) != nullptr) {
        hosts.emplace_back(text);
      }
    }
  }
  GENERAL_NAMES_free(names);
  return hosts;
}

std::string AdvertisedHost(const std::string& local_ip,
                           const std::vector<std::string>& certificate_hosts,
                           const std::string& hostname) {
  if (certificate_hosts.empty()) return local_ip;
  for (const std::string& name : certificate_hosts) {
    if (CertificateNameCovers(name, local_ip)) return local_ip;
  }
  for (const std::string& name : certificate_hosts) {
    if (!hostname.empty() && absl::EqualsIgnoreCase(name, hostname)) return name;
  }
  for (const std::string& name : certificate_hosts) {
    if (IsIpAddress(name) || absl::StartsWith(name, "*.")) continue;
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(name.c_str(), nullptr, &hints, &found) != 0) continue;
    bool match = false;
    for (addrinfo* a = found; a != nullptr && !match; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* raw =
          a->ai_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
      match = inet_ntop(a->ai_family, raw, text, sizeof(text)) != nullptr && local_ip == text;
    }
    freeaddrinfo(found);
    if (match) return name;
  }
  return "";
}

absl::Status CheckCertificateNamesAddress(const grpc::ServerContext& context,
                                          const std::string& address) {
  auto auth = context.auth_context();
  if (!auth || auth->FindPropertyValues("transport_security_type").empty() ||
      !auth->IsPeerAuthenticated()) {
    return absl::OkStatus();  // plaintext (--insecure)
  }
  const std::string host = HostOf(address);
  std::vector<std::string> names;
  for (const auto& name : auth->FindPropertyValues("x509_subject_alternative_name")) {
    names.emplace_back(name.data(), name.size());
    if (CertificateNameCovers(names.back(), host)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "this worker's certificate names ", names.empty() ? "no hosts" : absl::StrJoin(names, ", "),
      "; it may not register the address ", address,
      " (advertise an address the certificate names, or issue one that names ", host, ")"));
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(std::shared_ptr<AccessPolicy> policy,
                                                               bool require_client_certificate) {
  const RpcSecurity& security = CurrentRpcSecurity();
  if (security.insecure) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      require_client_certificate ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                 : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = security.ca_pem;
  options.pem_key_cert_pairs.push_back({security.key_pem, security.cert_pem});
  auto credentials = grpc::SslServerCredentials(options);
  if (policy) credentials->SetAuthMetadataProcessor(std::move(policy));
  return credentials;
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials() {
  const RpcSecurity& security = CurrentRpcSecurity();
  if (security.insecure) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = security.ca_pem;
  options.pem_private_key = security.key_pem;
  options.pem_cert_chain = security.cert_pem;
  auto credentials = grpc::SslCredentials(options);
  if (!security.token.empty()) {
    credentials = grpc::CompositeChannelCredentials(credentials,
                                                    grpc::AccessTokenCredentials(security.token));
  }
  return credentials;
}

}  // namespace pipemare
