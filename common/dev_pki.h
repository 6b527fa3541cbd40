// A development PKI: a fresh cluster CA, the certificates a coordinator and
// its workers present (common/security.h) and a pair of client tokens,
// written as files into one directory. Used by `pipemarectl local`,
// `pipemarectl dev-ca` (scripts/dev-ca.sh) and the multi-process tests; a
// production cluster brings certificates from its own CA.
#ifndef PIPEMARE_COMMON_DEV_PKI_H_
#define PIPEMARE_COMMON_DEV_PKI_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pipemare {

struct DevPkiOptions {
  std::string dir;
  // Hosts (names or IP addresses) the coordinator's certificate names.
  std::vector<std::string> coordinator_hosts = {"127.0.0.1", "localhost"};
  // One worker certificate per entry, naming that entry's hosts (a worker
  // may register only an address its certificate names).
  std::vector<std::vector<std::string>> workers = {{"127.0.0.1", "localhost"}};
  int days = 30;
  // Worker files named worker-HOST.pem after each entry's first host, also
  // for a single entry that names one host (pipemarectl dev-ca); a single
  // certificate shared by several hosts or a wildcard is worker.pem. False:
  // worker.pem whenever there is one entry.
  bool name_workers_by_host = false;
  // Replace a CA already in `dir` (its certificates stop being trusted);
  // false: refuse, naming the file.
  bool replace = true;
};

struct DevPki {
  std::string ca;                                      // ca.pem (ca.key beside it)
  std::string coordinator_cert, coordinator_key;       // coordinator.pem, .key
  std::vector<std::string> worker_certs, worker_keys;  // worker[-HOST].pem, .key
  std::string tokens;                                  // tokens: the coordinator's --tokens-file
  std::string submit_token, read_token;                // submit.token, read.token
};

// Writes the files into options.dir (created if missing; keys and tokens
// mode 0600). Errors name the file.
absl::StatusOr<DevPki> MakeDevPki(const DevPkiOptions& options);

// A random token of 32 hex digits (128 bits) from the system's CSPRNG.
std::string RandomToken();

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_DEV_PKI_H_
