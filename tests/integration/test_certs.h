#pragma once

// Certificates for the TLS tests, made by the `openssl` command, and the
// channel credentials that trust them (security_test.cc).

#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {

// PEM files: a CA, a server certificate for 127.0.0.1 and localhost, a
// client certificate from the same CA, and one from another CA.
struct Certs {
  std::string ca, server_cert, server_key, client_cert, client_key;
  std::string other_ca, other_client_cert, other_client_key;
};

inline bool HaveOpenssl() {
  std::string output;
  return RunCommand("command -v openssl", &output) == 0;
}

inline Certs MakeCerts(const std::string& dir) {
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const auto run = [&](const std::string& command) {
    std::string output;
    EXPECT_EQ(RunCommand("cd " + dir + " && " + command, &output), 0) << command << "\n" << output;
  };
  const auto make_ca = [&](const std::string& name) {
    run(absl::StrCat("openssl req -x509 ", ec, " -keyout ", name, ".key -out ", name,
                     ".pem -days 2 -subj /CN=", name));
  };
  const auto make_leaf = [&](const std::string& name, const std::string& ca,
                             const std::string& extensions) {
    std::ofstream(absl::StrCat(dir, "/", name, ".ext")) << extensions << "\n";
    run(absl::StrCat("openssl req ", ec, " -keyout ", name, ".key -out ", name,
                     ".csr -subj /CN=", name));
    run(absl::StrCat("openssl x509 -req -in ", name, ".csr -CA ", ca, ".pem -CAkey ", ca,
                     ".key -CAcreateserial -days 2 -out ", name, ".pem -extfile ", name, ".ext"));
  };
  make_ca("ca");
  make_ca("other-ca");
  make_leaf("server", "ca",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth");
  make_leaf("client", "ca", "extendedKeyUsage=clientAuth");
  make_leaf("other-client", "other-ca", "extendedKeyUsage=clientAuth");
  const auto path = [&](const std::string& name) { return dir + "/" + name; };
  // Private keys must be the owner's alone or the shard and the CLI refuse
  // them; openssl writes them 0600 today, this keeps the tests independent
  // of that.
  for (const char* key :
       {"ca.key", "other-ca.key", "server.key", "client.key", "other-client.key"}) {
    std::filesystem::permissions(
        path(key), std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  return Certs{path("ca.pem"),           path("server.pem"),      path("server.key"),
               path("client.pem"),       path("client.key"),      path("other-ca.pem"),
               path("other-client.pem"), path("other-client.key")};
}

inline std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline std::shared_ptr<grpc::ChannelCredentials> Tls(const std::string& ca,
                                                     const std::string& cert = "",
                                                     const std::string& key = "") {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ReadText(ca);
  if (!cert.empty()) {
    options.pem_cert_chain = ReadText(cert);
    options.pem_private_key = ReadText(key);
  }
  return grpc::SslCredentials(options);
}

}  // namespace layercast::testing
