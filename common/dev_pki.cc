#include "common/dev_pki.h"

#include <arpa/inet.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/security.h"

namespace pipemare {

namespace {

struct Freer {
  void operator()(X509* x) const { X509_free(x); }
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, Freer>;
using KeyPtr = std::unique_ptr<EVP_PKEY, Freer>;

bool AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

// A certificate for `key` named `common_name`, signed by `issuer` with
// `issuer_key` (self-signed when issuer is null): a CA when `hosts` is
// empty, else a TLS server-and-client certificate naming `hosts`.
X509Ptr MakeCertificate(EVP_PKEY* key, const std::string& common_name,
                        const std::vector<std::string>& hosts, X509* issuer, EVP_PKEY* issuer_key,
                        int days) {
  X509Ptr cert(X509_new());
  uint64_t serial = 0;
  RAND_bytes(reinterpret_cast<unsigned char*>(&serial), sizeof(serial));
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set_uint64(X509_get_serialNumber(cert.get()), serial >> 1);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);  // clocks a little apart
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(days) * 86400);
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("Pipemare development"), -1, -1,
                             0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                             0);
  X509* signer = issuer != nullptr ? issuer : cert.get();
  X509_set_issuer_name(cert.get(), X509_get_subject_name(signer));
  bool ok = AddExtension(cert.get(), signer, NID_subject_key_identifier, "hash");
  if (hosts.empty()) {
    ok = ok && AddExtension(cert.get(), signer, NID_basic_constraints, "critical,CA:TRUE") &&
         AddExtension(cert.get(), signer, NID_key_usage, "critical,keyCertSign,cRLSign");
  } else {
    std::vector<std::string> names;
    for (const std::string& host : hosts) {
      names.push_back(absl::StrCat(IsIpAddress(host) ? "IP:" : "DNS:", host));
    }
    ok = ok && AddExtension(cert.get(), signer, NID_basic_constraints, "critical,CA:FALSE") &&
         AddExtension(cert.get(), signer, NID_authority_key_identifier, "keyid") &&
         AddExtension(cert.get(), signer, NID_key_usage, "critical,digitalSignature") &&
         AddExtension(cert.get(), signer, NID_ext_key_usage, "serverAuth,clientAuth") &&
         AddExtension(cert.get(), signer, NID_subject_alt_name, absl::StrJoin(names, ","));
  }
  if (!ok || X509_sign(cert.get(), issuer_key != nullptr ? issuer_key : key, EVP_sha256()) == 0) {
    return nullptr;
  }
  return cert;
}

absl::Status WriteFile(const std::string& path, const std::string& text, bool secret) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (secret) chmod(tmp.c_str(), 0600);
    out << text;
    if (!out) return absl::InternalError(absl::StrCat(path, ": cannot be written"));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": cannot be written: ", ec.message()));
  return absl::OkStatus();
}

std::string CertPem(X509* cert) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), BIO_free);
  PEM_write_bio_X509(bio.get(), cert);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, n);
}

std::string KeyPem(EVP_PKEY* key) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), BIO_free);
  PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, n);
}

}  // namespace

std::string RandomToken() {
  unsigned char bytes[16];
  RAND_bytes(bytes, sizeof(bytes));
  std::string token;
  for (unsigned char b : bytes) absl::StrAppend(&token, absl::Hex(b, absl::kZeroPad2));
  return token;
}

absl::StatusOr<DevPki> MakeDevPki(const DevPkiOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(options.dir, ": ", ec.message()));
  const std::string dir = options.dir + "/";
  if (!options.replace && std::filesystem::exists(dir + "ca.pem")) {
    return absl::AlreadyExistsError(absl::StrCat(
        dir,
        "ca.pem exists: a new CA would stop every certificate and token made with it from "
        "working; give another --out, or --force to replace them"));
  }
  DevPki pki;
  KeyPtr ca_key(EVP_EC_gen("P-256"));
  if (!ca_key) return absl::InternalError("cannot generate a key (OpenSSL)");
  X509Ptr ca =
      MakeCertificate(ca_key.get(), "Pipemare development CA", {}, nullptr, nullptr, options.days);
  if (!ca) return absl::InternalError("cannot make the CA certificate (OpenSSL)");
  pki.ca = dir + "ca.pem";
  if (auto st = WriteFile(pki.ca, CertPem(ca.get()), false); !st.ok()) return st;
  if (auto st = WriteFile(dir + "ca.key", KeyPem(ca_key.get()), true); !st.ok()) return st;

  auto issue = [&](const std::string& stem, const std::string& common_name,
                   const std::vector<std::string>& hosts, std::string* cert_path,
                   std::string* key_path) -> absl::Status {
    KeyPtr key(EVP_EC_gen("P-256"));
    X509Ptr cert =
        key ? MakeCertificate(key.get(), common_name, hosts, ca.get(), ca_key.get(), options.days)
            : nullptr;
    if (!cert) return absl::InternalError(absl::StrCat("cannot make ", stem, ".pem (OpenSSL)"));
    *cert_path = dir + stem + ".pem";
    *key_path = dir + stem + ".key";
    if (auto st = WriteFile(*cert_path, CertPem(cert.get()), false); !st.ok()) return st;
    return WriteFile(*key_path, KeyPem(key.get()), true);
  };
  if (auto st = issue("coordinator", kCoordinatorName, options.coordinator_hosts,
                      &pki.coordinator_cert, &pki.coordinator_key);
      !st.ok()) {
    return st;
  }
  for (const auto& hosts : options.workers) {
    if (hosts.empty()) return absl::InvalidArgumentError("a worker certificate needs a host");
    const std::string stem =
        options.workers.size() == 1 && (!options.name_workers_by_host || hosts.size() > 1 ||
                                        absl::StrContains(hosts.front(), '*'))
            ? "worker"
            : absl::StrCat("worker-", absl::StrReplaceAll(hosts.front(), {{"*", "wildcard"}}));
    std::string cert, key;
    if (auto st = issue(stem, kWorkerName, hosts, &cert, &key); !st.ok()) return st;
    pki.worker_certs.push_back(cert);
    pki.worker_keys.push_back(key);
  }
  const std::string submit = RandomToken(), read = RandomToken();
  pki.tokens = dir + "tokens";
  pki.submit_token = dir + "submit.token";
  pki.read_token = dir + "read.token";
  const std::string tokens =
      absl::StrCat("# NAME ROLE TOKEN: the coordinator's --tokens-file (PIPEMARE_TOKENS_FILE)\n",
                   "admin submit ", submit, "\n", "viewer read ", read, "\n");
  for (const auto& [path, text] :
       std::vector<std::pair<std::string, std::string>>{{pki.tokens, tokens},
                                                        {pki.submit_token, submit + "\n"},
                                                        {pki.read_token, read + "\n"}}) {
    if (auto st = WriteFile(path, text, true); !st.ok()) return st;
  }
  return pki;
}

}  // namespace pipemare
