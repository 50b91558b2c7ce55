#include "server/access/tls_credentials.h"

#include <grpcpp/security/server_credentials.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/strings/str_cat.h"
#include "platform/status_macros.h"
#include "server/access/auth_file.h"

namespace layercast::server {
namespace {

// PEM bundles are a few KiB; a CA bundle may hold a few hundred certificates.
constexpr uint64_t kMaxPemBytes = 4 << 20;

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;

Bio MemoryBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Never prompts on a terminal for an encrypted key's passphrase.
int NoPassphrase(char*, int, int, void*) { return 0; }

absl::Status Invalid(const std::string& flag, const std::string& path, const std::string& problem) {
  ERR_clear_error();
  return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, " ", problem));
}

// The first certificate of `pem`; with `check_expiry`, refused once expired
// (a CA bundle may well hold expired certificates beside current ones).
absl::StatusOr<Cert> ParseCertificate(const std::string& pem, const std::string& flag,
                                      const std::string& path, bool check_expiry) {
  Bio bio = MemoryBio(pem);
  Cert cert(PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr));
  if (cert == nullptr) {
    return Invalid(flag, path, "holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
  }
  if (check_expiry && X509_cmp_current_time(X509_get0_notAfter(cert.get())) < 0) {
    return Invalid(flag, path, "holds a certificate that has expired: renew it");
  }
  return cert;
}

}  // namespace

absl::StatusOr<ServerSecurity> ServerSecurityFor(const layercast::v1::ShardConfig& config,
                                                 FileSystem& fs) {
  ServerSecurity security;
  const bool cert = !config.tls_cert_file().empty();
  const bool key = !config.tls_key_file().empty();
  if (cert != key) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls-cert-file (PEM certificate chain) and --tls-key-file (its PEM "
        "private key); give both, or neither for plaintext");
  }
  if (!cert) {
    if (!config.tls_client_ca_file().empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca-file turns on mutual TLS, which needs TLS: give --tls-cert-file and "
          "--tls-key-file too");
    }
    security.credentials = grpc::InsecureServerCredentials();
    return security;
  }

  ASSIGN_OR_RETURN(std::string cert_pem,
                   ReadCredentialFile(config.tls_cert_file(), "tls-cert-file", kMaxPemBytes,
                                      CredentialKind::kPublic, fs));
  ASSIGN_OR_RETURN(std::string key_pem,
                   ReadCredentialFile(config.tls_key_file(), "tls-key-file", kMaxPemBytes,
                                      CredentialKind::kSecret, fs));
  ASSIGN_OR_RETURN(Cert leaf, ParseCertificate(cert_pem, "tls-cert-file", config.tls_cert_file(),
                                               /*check_expiry=*/true));
  Bio key_bio = MemoryBio(key_pem);
  Key private_key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, NoPassphrase, nullptr));
  if (private_key == nullptr) {
    return Invalid("tls-key-file", config.tls_key_file(),
                   "holds no unencrypted PEM private key (-----BEGIN PRIVATE KEY-----); "
                   "decrypt it first (openssl pkey -in KEY -out KEY.plain)");
  }
  if (X509_check_private_key(leaf.get(), private_key.get()) != 1) {
    return Invalid("tls-key-file", config.tls_key_file(),
                   absl::StrCat("is not the private key of the certificate in --tls-cert-file ",
                                config.tls_cert_file()));
  }

  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({key_pem, cert_pem});
  security.tls = true;
  if (!config.tls_client_ca_file().empty()) {
    ASSIGN_OR_RETURN(std::string ca_pem,
                     ReadCredentialFile(config.tls_client_ca_file(), "tls-client-ca-file",
                                        kMaxPemBytes, CredentialKind::kPublic, fs));
    ASSIGN_OR_RETURN(Cert ca,
                     ParseCertificate(ca_pem, "tls-client-ca-file", config.tls_client_ca_file(),
                                      /*check_expiry=*/false));
    options.pem_root_certs = ca_pem;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    security.mutual = true;
  }
  security.credentials = grpc::SslServerCredentials(options);
  return security;
}

}  // namespace layercast::server
