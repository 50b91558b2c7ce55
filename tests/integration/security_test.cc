// Transport security, admin tokens and request limits on real shard
// processes, with certificates made here by the `openssl` command (the tests
// skip, saying so, where it is not installed): a TLS shard refuses plaintext
// clients and serves TLS clients bit-exact; a mutual-TLS shard refuses
// clients without a certificate from its CA; ShardAdmin needs the right
// bearer token; oversized requests are refused before they are parsed.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpcpp/generic/generic_stub.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/cast.h"
#include "core/synthetic_model.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/relay_process.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_certs.h"
#include "tests/prerequisite.h"

namespace layercast::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kSpec[] = "llama:layers=2,hidden=96,ffn=160,vocab=300,seed=9";
constexpr char kPolicy[] = "p=f32,c=bf16;*norm*=f32;lm_head.*=f16";
constexpr char kToken[] = "security-test-token-abcdef0123456789";

// Writes `content` to `path` with exactly the permissions `mode` (not
// whatever the umask leaves).
void WriteFileWithMode(const std::string& path, const std::string& content,
                       std::filesystem::perms mode) {
  std::ofstream(path) << content;
  std::filesystem::permissions(path, mode);
}

// A token file only its owner may read, as the shard and the CLI require.
std::string WriteToken(const std::string& content) {
  const std::string path = MakeTempDir("secret") + "/token";
  WriteFileWithMode(path, content,
                    std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  return path;
}

// One GetManifest without waiting for the connection: how a client that
// cannot complete the handshake fails.
grpc::Status GetManifest(const std::string& address,
                         std::shared_ptr<grpc::ChannelCredentials> credentials) {
  auto stub = layercast::v1::ShardService::NewStub(grpc::CreateChannel(address, credentials));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  layercast::v1::Manifest manifest;
  return stub->GetManifest(&context, {}, &manifest);
}

absl::StatusOr<std::unique_ptr<client::ShardSet>> Connect(
    const tools::LocalShardSet& processes, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::seconds(60);
  options.credentials = std::move(credentials);
  return client::ShardSet::Connect(processes.addresses(), options);
}

// Every tensor of every layer equals the core cast of the synthetic master.
void ExpectBitExact(const client::ShardSet& set) {
  auto source = SyntheticModel::Create(kSpec);
  ASSERT_TRUE(source.ok());
  for (uint32_t l = 0; l < set.model().layers.size(); ++l) {
    absl::StatusOr<client::Layer> layer = set.Gather(l);
    ASSERT_TRUE(layer.ok()) << layer.status();
    for (uint32_t t = 0; t < layer->num_tensors(); ++t) {
      const client::Layer::TensorView view = layer->tensor(t);
      std::vector<float> master(view.num_elements);
      ASSERT_TRUE((*source)->Read(l, t, ElementRange{0, view.num_elements}, master).ok());
      std::vector<uint8_t> expected(view.bytes.size());
      ASSERT_TRUE(CastFromF32(master.data(), expected.data(), master.size(), view.dtype,
                              Fp16Overflow::kError)
                      .ok());
      ASSERT_EQ(std::memcmp(expected.data(), view.bytes.data(), expected.size()), 0) << view.name;
    }
  }
}

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveOpenssl()) {
      LAYERCAST_PREREQUISITE_MISSING(
          "the openssl command is not installed (apt-get install openssl); the TLS tests need it "
          "to make their certificates");
    }
    certs_ = MakeCerts(MakeTempDir("certs"));
  }

  std::vector<std::string> TlsFlags() const {
    return {"--synthetic",     kSpec,
            "--policy",        kPolicy,
            "--tls-cert-file", certs_.server_cert,
            "--tls-key-file",  certs_.server_key};
  }

  Certs certs_;
};

TEST_F(SecurityTest, TlsRefusesPlaintextClientsAndServesTlsClientsBitExact) {
  auto processes = StartProcesses(2, TlsFlags());
  ASSERT_NE(processes, nullptr);
  const std::string address = processes->addresses()[0];

  EXPECT_EQ(GetManifest(address, grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(GetManifest(address, Tls(certs_.other_ca)).error_code(), grpc::StatusCode::UNAVAILABLE)
      << "a server certificate from an untrusted CA is refused";

  auto set = Connect(*processes, Tls(certs_.ca));
  ASSERT_TRUE(set.ok()) << set.status();
  ExpectBitExact(**set);

  std::string output;
  const std::string shards = processes->addresses()[0] + "," + processes->addresses()[1];
  EXPECT_EQ(RunCommand(CliBinary() + " manifest --shards " + shards + " --tls-ca-file " + certs_.ca,
                       &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("model     synthetic:llama:layers=2"));
  EXPECT_EQ(
      RunCommand(CliBinary() + " manifest --connect-timeout-ms 2000 --shards " + shards, &output),
      1)
      << "plaintext CLI: " << output;
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

TEST_F(SecurityTest, ARelayOfTlsShardsServesTlsOrRefusesToStart) {
  auto processes = StartProcesses(2, TlsFlags());
  ASSERT_NE(processes, nullptr);
  const std::string shards = processes->addresses()[0] + "," + processes->addresses()[1];
  std::string output;
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " relay --shards ", shards, " --tls-ca-file ",
                                    certs_.ca, " --listen 127.0.0.1:0,127.0.0.1:0"),
                       &output),
            1)
      << "would serve TLS shards' model in plaintext: " << output;
  EXPECT_THAT(output, HasSubstr("--serve-tls-cert-file"));

  RelayProcess relay(MakeTempDir("tls-relay"), "relay", processes->addresses(), "",
                     {"--tls-ca-file", certs_.ca, "--serve-tls-cert-file", certs_.server_cert,
                      "--serve-tls-key-file", certs_.server_key});
  ASSERT_EQ(relay.addresses().size(), 2u) << relay.log();
  EXPECT_EQ(GetManifest(relay.addresses()[0], grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::seconds(60);
  options.credentials = Tls(certs_.ca);
  auto set = client::ShardSet::Connect(relay.addresses(), options);
  ASSERT_TRUE(set.ok()) << set.status();
  ExpectBitExact(**set);
}

TEST_F(SecurityTest, ARelayOfMutualTlsShardsAuthenticatesItsReadersOrRefusesToStart) {
  std::vector<std::string> flags = TlsFlags();
  flags.insert(flags.end(), {"--tls-client-ca-file", certs_.ca});
  auto processes = StartProcesses(2, flags);
  ASSERT_NE(processes, nullptr);
  const std::vector<std::string> upstream = {
      "--tls-ca-file",        certs_.ca,         "--tls-cert-file",       certs_.client_cert,
      "--tls-key-file",       certs_.client_key, "--serve-tls-cert-file", certs_.server_cert,
      "--serve-tls-key-file", certs_.server_key};
  std::string output;
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " relay --shards ", processes->addresses()[0], ",",
                                    processes->addresses()[1], " ", absl::StrJoin(upstream, " "),
                                    " --listen 127.0.0.1:0,127.0.0.1:0"),
                       &output),
            1)
      << "would serve mutual-TLS shards' model to readers without a certificate: " << output;
  EXPECT_THAT(output, AllOf(HasSubstr("--serve-tls-client-ca-file"),
                            HasSubstr("--serve-without-client-certificates")));

  const std::string dir = MakeTempDir("mtls-relay");
  std::vector<std::string> mutual = upstream;
  mutual.insert(mutual.end(), {"--serve-tls-client-ca-file", certs_.ca});
  RelayProcess relay(dir, "relay", processes->addresses(), "", mutual);
  ASSERT_EQ(relay.addresses().size(), 2u) << relay.log();
  EXPECT_THAT(ReadText(relay.log()),
              HasSubstr("readers must present a certificate signed by a CA in " + certs_.ca));
  EXPECT_EQ(GetManifest(relay.addresses()[0], Tls(certs_.ca)).error_code(),
            grpc::StatusCode::UNAVAILABLE)
      << "no client certificate";
  EXPECT_EQ(GetManifest(relay.addresses()[1],
                        Tls(certs_.ca, certs_.other_client_cert, certs_.other_client_key))
                .error_code(),
            grpc::StatusCode::UNAVAILABLE)
      << "a client certificate from another CA";
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::seconds(60);
  options.credentials = Tls(certs_.ca, certs_.client_cert, certs_.client_key);
  auto set = client::ShardSet::Connect(relay.addresses(), options);
  ASSERT_TRUE(set.ok()) << set.status();
  ExpectBitExact(**set);
  EXPECT_EQ(relay.Stop(), absl::OkStatus());

  // Said on purpose, and said in the log.
  std::vector<std::string> open = upstream;
  open.push_back("--serve-without-client-certificates");
  RelayProcess open_relay(dir, "open-relay", processes->addresses(), "", open);
  ASSERT_EQ(open_relay.addresses().size(), 2u) << open_relay.log();
  EXPECT_THAT(ReadText(open_relay.log()),
              HasSubstr("readers are not authenticated: --serve-without-client-certificates"));
  EXPECT_TRUE(GetManifest(open_relay.addresses()[0], Tls(certs_.ca)).ok());
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

TEST_F(SecurityTest, MutualTlsNeedsAClientCertificateFromTheTrustedCa) {
  std::vector<std::string> flags = TlsFlags();
  flags.insert(flags.end(), {"--tls-client-ca-file", certs_.ca});
  auto processes = StartProcesses(1, flags);
  ASSERT_NE(processes, nullptr);
  const std::string address = processes->addresses()[0];

  EXPECT_EQ(GetManifest(address, Tls(certs_.ca)).error_code(), grpc::StatusCode::UNAVAILABLE)
      << "no client certificate";
  EXPECT_EQ(GetManifest(address, Tls(certs_.ca, certs_.other_client_cert, certs_.other_client_key))
                .error_code(),
            grpc::StatusCode::UNAVAILABLE)
      << "a client certificate from another CA";
  EXPECT_EQ(GetManifest(address, grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);

  auto set = Connect(*processes, Tls(certs_.ca, certs_.client_cert, certs_.client_key));
  ASSERT_TRUE(set.ok()) << set.status();
  ExpectBitExact(**set);

  std::string output;
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " manifest --shards ", address, " --tls-ca-file ",
                                    certs_.ca, " --tls-cert-file ", certs_.client_cert,
                                    " --tls-key-file ", certs_.client_key),
                       &output),
            0)
      << output;
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

TEST_F(SecurityTest, HealthListenServesPlaintextProbesBesideTls) {
  std::vector<std::string> flags = TlsFlags();
  flags.insert(flags.end(), {"--tls-client-ca-file", certs_.ca, "--health-listen", "127.0.0.1:0"});
  const std::string logs = MakeTempDir("logs");
  auto processes = StartProcesses(1, flags, logs);
  ASSERT_NE(processes, nullptr);
  ASSERT_TRUE(Connect(*processes, Tls(certs_.ca, certs_.client_cert, certs_.client_key)).ok());

  const std::string log = ReadText(logs + "/shard-0.log");
  // "health on 127.0.0.1:PORT (plaintext)"
  constexpr char kHealthOn[] = "health on 127.0.0.1:";
  const size_t begin = log.find(kHealthOn);
  ASSERT_NE(begin, std::string::npos) << log;
  const size_t port_begin = begin + sizeof(kHealthOn) - 1;
  const std::string health_address =
      "127.0.0.1:" + log.substr(port_begin, log.find(' ', port_begin) - port_begin);
  EXPECT_THAT(log, AllOf(HasSubstr("health on " + health_address + " (plaintext)"),
                         HasSubstr("(mutual TLS)")));
  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(health_address, grpc::InsecureChannelCredentials()));
  for (const std::string service : {"", "layercast.v1.ShardService"}) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, request, &response);
    ASSERT_TRUE(status.ok()) << "'" << service << "': " << status.error_message();
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  // The health port serves nothing else.
  EXPECT_EQ(GetManifest(health_address, grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

TEST_F(SecurityTest, BadTlsFilesStopTheShardWithOneLine) {
  std::string output;
  const std::string base =
      ShardBinary() + " --listen 127.0.0.1:0 --num-shards 1 --synthetic llama:layers=1 ";
  EXPECT_EQ(RunCommand(base + "--tls-cert-file " + certs_.server_cert, &output), 2);
  EXPECT_THAT(output, HasSubstr("TLS needs both --tls-cert-file"));
  EXPECT_EQ(RunCommand(base + "--tls-cert-file " + certs_.server_cert + " --tls-key-file " +
                           certs_.client_key,
                       &output),
            2);
  EXPECT_THAT(output, HasSubstr("--tls-key-file " + certs_.client_key +
                                " is not the private key of the certificate"));
  EXPECT_EQ(RunCommand(base + "--tls-cert-file " + certs_.server_key + " --tls-key-file " +
                           certs_.server_key,
                       &output),
            2);
  EXPECT_THAT(output, HasSubstr("holds no PEM certificate"));
  EXPECT_EQ(RunCommand(base + "--tls-client-ca-file " + certs_.ca, &output), 2);
  EXPECT_THAT(output, HasSubstr("mutual TLS, which needs TLS"));
}

// ShardAdmin.Checkpoint with `authorization` metadata `value` (none if
// empty).
grpc::Status Checkpoint(const std::string& address,
                        std::shared_ptr<grpc::ChannelCredentials> credentials,
                        const std::string& value,
                        layercast::v1::CheckpointResponse* response = nullptr) {
  auto stub = layercast::v1::ShardAdmin::NewStub(grpc::CreateChannel(address, credentials));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (!value.empty()) context.AddMetadata("authorization", value);
  layercast::v1::CheckpointResponse ignored;
  return stub->Checkpoint(&context, {}, response != nullptr ? response : &ignored);
}

TEST_F(SecurityTest, CheckpointNeedsTheRightBearerToken) {
  const std::string dir = MakeTempDir("checkpoints");
  const std::string token = WriteToken(absl::StrCat("  ", kToken, "\n\n"));  // trimmed when read
  std::vector<std::string> flags = TlsFlags();
  flags.insert(flags.end(), {"--checkpoint-dir", dir, "--admin-token-file", token});
  auto processes = StartProcesses(1, flags);
  ASSERT_NE(processes, nullptr);
  ASSERT_TRUE(Connect(*processes, Tls(certs_.ca)).ok());
  const std::string address = processes->addresses()[0];
  const auto tls = Tls(certs_.ca);

  const grpc::Status missing = Checkpoint(address, tls, "");
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(missing.error_message(),
              HasSubstr("send the metadata 'authorization: Bearer <token>'"));
  EXPECT_EQ(Checkpoint(address, tls, absl::StrCat("Basic ", kToken)).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  const grpc::Status wrong = Checkpoint(address, tls, "Bearer not-the-token-0123456789");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(wrong.error_message(), HasSubstr("does not match this shard's --admin-token-file"));
  EXPECT_EQ(Checkpoint(address, tls, absl::StrCat("Bearer ", kToken, "x")).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_FALSE(std::filesystem::exists(dir + "/shard-0-of-1.safetensors"))
      << "a refused call wrote nothing";

  layercast::v1::CheckpointResponse response;
  const grpc::Status right = Checkpoint(address, tls, absl::StrCat("bearer ", kToken), &response);
  ASSERT_TRUE(right.ok()) << right.error_message();
  EXPECT_EQ(response.path(), dir + "/shard-0-of-1.safetensors");
  EXPECT_EQ(response.bytes(), std::filesystem::file_size(response.path()));
  EXPECT_EQ(response.version(), 0u);
  EXPECT_EQ(response.num_shards(), 1u);
  EXPECT_THAT(response.checksum(), ::testing::StartsWith("sha256:"));

  // The CLI over TLS, with the token from the same file.
  std::string output;
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " checkpoint --shards ", address,
                                    " --tls-ca-file ", certs_.ca, " --token-file ", token),
                       &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("shard 0/1  version 0"));
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

TEST_F(SecurityTest, WithoutATokenEveryAdminCallIsRefused) {
  auto processes =
      StartProcesses(1, {"--synthetic", kSpec, "--checkpoint-dir", MakeTempDir("checkpoints")});
  ASSERT_NE(processes, nullptr);
  ASSERT_TRUE(Connect(*processes, grpc::InsecureChannelCredentials()).ok());
  const grpc::Status status =
      Checkpoint(processes->addresses()[0], grpc::InsecureChannelCredentials(),
                 absl::StrCat("Bearer ", kToken));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("start it with --admin-token-file FILE"));
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

TEST_F(SecurityTest, ShortTokenFilesStopTheShard) {
  const std::string token = WriteToken("short\n");
  std::string output;
  EXPECT_EQ(RunCommand(ShardBinary() +
                           " --listen 127.0.0.1:0 --num-shards 1 --synthetic "
                           "llama:layers=1 --admin-token-file " +
                           token,
                       &output),
            2);
  EXPECT_THAT(output, HasSubstr("--admin-token-file " + token + " holds a token of 5 characters"));
}

// A listener at a peer's address, as an attacker on the path would hold
// it: a shard with an admin token and plaintext peers refuses to start
// rather than send the token there, unless --peers-insecure vouches for the
// network.
TEST_F(SecurityTest, PeersNeverGetTheTokenInClearTextUnlessTheNetworkIsVouchedFor) {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor peer(
      io, boost::asio::ip::tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), 0));
  peer.non_blocking(true);
  const std::string peers = absl::StrCat("127.0.0.1:1,127.0.0.1:", peer.local_endpoint().port());
  const std::string token = WriteToken(absl::StrCat(kToken, "\n"));
  const std::string base = absl::StrCat("timeout 60 ", ShardBinary(),
                                        " --listen 127.0.0.1:0 --num-shards 2 --shard-index 0 "
                                        "--synthetic llama:layers=1 --admin-token-file ",
                                        token, " --peers ", peers);
  std::string output;
  EXPECT_EQ(RunCommand(base, &output), 2) << output;
  EXPECT_THAT(output, AllOf(HasSubstr("would send its admin token to its peers in clear text"),
                            HasSubstr("--tls-cert-file"), HasSubstr("--peers-insecure")));
  boost::system::error_code error;
  boost::asio::ip::tcp::socket visitor(io);
  peer.accept(visitor, error);
  EXPECT_EQ(error, boost::asio::error::would_block) << "nothing ever connected to the peer";

  // Vouched for, it starts (and says so); `timeout` ends it.
  EXPECT_EQ(RunCommand("timeout 3 " + base.substr(std::string("timeout 60 ").size()) +
                           " --peers-insecure true",
                       &output),
            124)
      << output;
  EXPECT_THAT(output,
              HasSubstr("--peers-insecure: the admin token goes to the peers in clear text"));
}

TEST_F(SecurityTest, SecretFilesOtherUsersCanReadStopTheShardAndTheCli) {
  using std::filesystem::perms;
  const std::string dir = MakeTempDir("loose");
  const std::string token = dir + "/token";
  WriteFileWithMode(
      token, absl::StrCat(kToken, "\n"),
      perms::owner_read | perms::owner_write | perms::group_read | perms::others_read);
  const std::string key = dir + "/server.key";
  WriteFileWithMode(key, ReadText(certs_.server_key),
                    perms::owner_read | perms::owner_write | perms::others_read);
  std::string output;
  // `timeout`: a shard that accepted the file would serve until killed.
  const std::string base = "timeout 60 " + ShardBinary() +
                           " --listen 127.0.0.1:0 --num-shards 1 --synthetic llama:layers=1 ";

  EXPECT_EQ(RunCommand(base + "--admin-token-file " + token, &output), 2);
  EXPECT_THAT(output, AllOf(HasSubstr("--admin-token-file " + token + " has mode 0644"),
                            HasSubstr("chmod 600 " + token)));
  EXPECT_EQ(RunCommand(base + "--tls-cert-file " + certs_.server_cert + " --tls-key-file " + key,
                       &output),
            2);
  EXPECT_THAT(output, AllOf(HasSubstr("--tls-key-file " + key + " has mode 0604"),
                            HasSubstr("chmod 600 " + key)));

  // The CLI refuses its copy of the token before it connects to anything.
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(),
                                    " checkpoint --connect-timeout-ms 2000 --shards 127.0.0.1:1",
                                    " --tls-ca-file ", certs_.ca, " --token-file ", token),
                       &output),
            1);
  EXPECT_THAT(output, AllOf(HasSubstr("--token-file " + token + " has mode 0644"),
                            HasSubstr("chmod 600 " + token)));

  // Certificates are public: 0644 is fine (MakeCerts leaves them so), and a
  // private key of 0600 next to it starts the shard.
  WriteFileWithMode(key, ReadText(certs_.server_key), perms::owner_read | perms::owner_write);
  auto processes = StartProcesses(
      1, {"--synthetic", kSpec, "--tls-cert-file", certs_.server_cert, "--tls-key-file", key});
  ASSERT_NE(processes, nullptr);
  EXPECT_TRUE(Connect(*processes, Tls(certs_.ca)).ok());
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

TEST_F(SecurityTest, CheckpointCommandRefusesToSendTheTokenInClearText) {
  const std::string dir = MakeTempDir("checkpoints");
  const std::string token = WriteToken(absl::StrCat(kToken, "\n"));
  auto processes = StartProcesses(
      1, {"--synthetic", kSpec, "--checkpoint-dir", dir, "--admin-token-file", token});
  ASSERT_NE(processes, nullptr);
  ASSERT_TRUE(Connect(*processes, grpc::InsecureChannelCredentials()).ok());
  const std::string address = processes->addresses()[0];

  std::string output;
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " checkpoint --shards ", address, " --token-file ",
                                    token),
                       &output),
            2);
  EXPECT_THAT(output, AllOf(HasSubstr("the admin token would cross the network in clear text"),
                            HasSubstr("--tls-ca-file"), HasSubstr("--insecure")));
  EXPECT_FALSE(std::filesystem::exists(dir + "/shard-0-of-1.safetensors")) << "nothing was sent";

  // --insecure takes no value: the flag after it is still read as a flag.
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " checkpoint --insecure --shards ", address,
                                    " --token-file ", token),
                       &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("shard 0/1  version 0"));
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

// A unary call of `bytes` zero bytes to GetManifest: what the shard says
// about a request of that size.
grpc::StatusCode OversizedGetManifest(const std::string& address, size_t bytes) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  const std::string payload(bytes, '\0');
  grpc::Slice slice(payload);
  grpc::ByteBuffer request(&slice, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/layercast.v1.ShardService/GetManifest", grpc::StubOptions(), &request,
                 &response, [&](grpc::Status status) { done.set_value(status); });
  return done.get_future().get().error_code();
}

TEST(LimitsTest, OversizedRequestsAreRefusedBeforeTheyAreParsed) {
  auto processes = StartProcesses(1, {"--synthetic", "llama:layers=1,hidden=64"});
  ASSERT_NE(processes, nullptr);
  EXPECT_EQ(OversizedGetManifest(processes->addresses()[0], 128 << 10),
            grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "above the 64 KiB default";
  EXPECT_EQ(processes->Stop(), absl::OkStatus());

  processes = StartProcesses(
      1, {"--synthetic", "llama:layers=1,hidden=64", "--max-receive-message-bytes", "2048"});
  ASSERT_NE(processes, nullptr);
  EXPECT_EQ(OversizedGetManifest(processes->addresses()[0], 4096),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

// A live hand-over over TLS: a new shard trusting the old set's CA fills
// itself from it; one trusting another CA is refused the handshake and
// does not start.
TEST_F(SecurityTest, HandOverReadsTheOldSetOverTls) {
  const std::string token = WriteToken(kToken);
  std::vector<std::string> flags = TlsFlags();
  flags.insert(flags.end(),
               {"--optimizer", "sgd:lr=0.01,momentum=0.9", "--admin-token-file", token});
  auto old_set = StartProcesses(2, flags);
  ASSERT_NE(old_set, nullptr);
  for (const std::string& address : old_set->addresses()) {
    auto admin = layercast::v1::ShardAdmin::NewStub(grpc::CreateChannel(address, Tls(certs_.ca)));
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    layercast::v1::HandOverRequest request;
    request.set_at_version(0);
    layercast::v1::HandOverResponse answer;
    ASSERT_TRUE(admin->HandOver(&context, request, &answer).ok()) << address;
    EXPECT_TRUE(answer.at_boundary());
  }
  flags.insert(flags.end(), {"--hand-over-from", absl::StrJoin(old_set->addresses(), ",")});
  const auto start = [&](const std::string& ca, const std::string& logs) {
    tools::LocalShardSet::Options options;
    options.shard_binary = ShardBinary();
    options.num_shards = 1;
    options.extra_flags = flags;
    options.extra_flags.insert(options.extra_flags.end(), {"--peer-tls-ca-file", ca});
    options.log_dir = logs;
    return tools::LocalShardSet::Start(options);
  };
  const std::string refused_logs = MakeTempDir("handover-tls-refused");
  EXPECT_FALSE(start(certs_.other_ca, refused_logs).ok());
  std::string log;
  EXPECT_EQ(RunCommand(absl::StrCat("cat ", refused_logs, "/shard-0.log"), &log), 0);
  EXPECT_THAT(log, HasSubstr("--hand-over-from: old shard 0"));
  const std::string logs = MakeTempDir("handover-tls");
  auto new_set = start(certs_.ca, logs);
  ASSERT_TRUE(new_set.ok()) << new_set.status();
  auto set = Connect(**new_set, Tls(certs_.ca));
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(RunCommand(absl::StrCat("cat ", logs, "/shard-0.log"), &log), 0);
  EXPECT_THAT(log, HasSubstr("filling this shard from the 2 shards of a running set"));
  EXPECT_EQ((*new_set)->Stop(), absl::OkStatus());
}

}  // namespace
}  // namespace layercast::testing
