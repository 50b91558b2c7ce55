// Checkpoints of real shard processes: written on `layercast checkpoint` and
// on SIGTERM; a restarted shard set serves them, bit for bit, in preference
// to its --model; a corrupt or mismatched checkpoint stops the shard with
// exit status 2 and one line naming the file; a SIGKILL in the middle of a
// large write leaves the previous checkpoint whole.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/weight_publisher.h"
#include "core/cast.h"
#include "core/policy.h"
#include "core/synthetic_model.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "server/checkpoints/checkpoint_source.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kPolicy[] = "p=f32,c=bf16;*norm*=f32";
constexpr char kToken[] = "checkpoint-test-token-0123456789";

std::string WriteToken(const std::string& dir) { return WriteAdminToken(dir, kToken); }

std::unique_ptr<client::ShardSet> Connect(const tools::LocalShardSet& processes) {
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::seconds(120);
  auto set = client::ShardSet::Connect(processes.addresses(), options);
  EXPECT_TRUE(set.ok()) << set.status();
  return set.ok() ? *std::move(set) : nullptr;
}

// Every tensor of every layer, gathered: its bytes, or (for big models) a
// hash of them.
using Gathered = std::map<std::string, std::string>;
Gathered GatherAll(const client::ShardSet& set, bool hash_only = false) {
  Gathered gathered;
  for (uint32_t l = 0; l < set.model().layers.size(); ++l) {
    absl::StatusOr<client::Layer> layer = set.Gather(l);
    EXPECT_TRUE(layer.ok()) << layer.status();
    if (!layer.ok()) return {};
    for (size_t t = 0; t < layer->num_tensors(); ++t) {
      const client::Layer::TensorView view = layer->tensor(t);
      std::string bytes(reinterpret_cast<const char*>(view.bytes.data()), view.bytes.size());
      gathered[std::string(view.name)] =
          hash_only ? absl::StrCat(std::hash<std::string>{}(bytes), ":", bytes.size()) : bytes;
    }
  }
  return gathered;
}

std::string ReadLog(const std::string& log_dir, int shard) {
  std::ifstream in(absl::StrCat(log_dir, "/shard-", shard, ".log"));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string Sha256Sum(const std::string& path) {
  std::string output;
  EXPECT_EQ(RunCommand("sha256sum " + path, &output), 0) << output;
  return output.substr(0, 64);
}

// Runs layercast-shard with `flags` to its end: its exit status and output.
int RunShard(const std::string& flags, std::string* output) {
  return RunCommand(ShardBinary() + " --listen 127.0.0.1:0 " + flags, output);
}

TEST(CheckpointTest, RestartedShardsServeTheirCheckpointInsteadOfTheModel) {
  const std::string dir = MakeTempDir("checkpoints");
  const std::string logs = MakeTempDir("logs");
  const std::string token = WriteToken(MakeTempDir("secret"));
  const TestModel model = WriteTestModel(MakeTempDir("model") + "/model.safetensors", 2, 11);
  const std::vector<std::string> flags = {
      "--model",          model.path, "--policy",           kPolicy,
      "--checkpoint-dir", dir,        "--admin-token-file", token};
  Gathered before;
  {
    auto processes = StartProcesses(3, flags);
    ASSERT_NE(processes, nullptr);
    auto set = Connect(*processes);
    ASSERT_NE(set, nullptr);
    before = GatherAll(*set);
    std::string output;
    ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " checkpoint --shards ",
                                      absl::StrJoin(processes->addresses(), ","), " --token-file ",
                                      token, " --insecure"),
                         &output),
              0)
        << output;
    EXPECT_THAT(output, AllOf(HasSubstr("shard 0/3  version 0"), HasSubstr("shard 2/3  version 0"),
                              HasSubstr("shard-1-of-3.safetensors"), HasSubstr("sha256:")));
    EXPECT_EQ(processes->Stop(), absl::OkStatus());
  }
  ASSERT_FALSE(before.empty());
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::filesystem::exists(absl::StrCat(dir, "/shard-", i, "-of-3.safetensors")));
  }

  // Same names and shapes, other values: a shard that read the model instead
  // of its checkpoint would serve these.
  const TestModel other = WriteTestModel(model.path, 2, 12);
  {
    const std::vector<float>& head = other.values.at("lm_head.weight");
    std::string other_bytes(head.size() * 2, '\0');
    ASSERT_TRUE(CastFromF32(head.data(), other_bytes.data(), head.size(), DType::kBFloat16,
                            Fp16Overflow::kError)
                    .ok());
    ASSERT_NE(other_bytes, before.at("lm_head.weight")) << "the rewritten model must differ";
  }
  // A model replaced under the same name is not shadowed silently by the
  // old model's checkpoint: the start is refused, naming both fingerprints.
  {
    std::string output;
    EXPECT_EQ(RunShard(absl::StrCat("--shard-index 0 --num-shards 3 --model ", model.path,
                                    " --policy '", kPolicy, "' --checkpoint-dir ", dir),
                       &output),
              2)
        << output;
    EXPECT_THAT(output, AllOf(HasSubstr("the model was replaced"),
                              HasSubstr("--checkpoint-over-changed-model")));
  }
  // Told explicitly, the checkpoint wins.
  std::vector<std::string> keep_checkpoint = flags;
  keep_checkpoint.insert(keep_checkpoint.end(), {"--checkpoint-over-changed-model", "true"});
  auto processes = StartProcesses(3, keep_checkpoint, logs);
  ASSERT_NE(processes, nullptr);
  auto set = Connect(*processes);
  ASSERT_NE(set, nullptr);
  const Gathered after = GatherAll(*set);
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, bytes] : before) {
    ASSERT_TRUE(after.at(name) == bytes) << name << " differs from before the restart";
  }
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
  for (int i = 0; i < 3; ++i) {
    const std::string log = ReadLog(logs, i);
    EXPECT_THAT(log, HasSubstr(absl::StrCat("loading checkpoint ", dir, "/shard-", i,
                                            "-of-3.safetensors (version 0) instead of --model")));
    EXPECT_THAT(log, HasSubstr("serving the checkpoint as told"));
    EXPECT_THAT(log, HasSubstr("already holds version 0")) << "nothing new to write on SIGTERM";
  }
}

TEST(CheckpointTest, SigtermWritesTheCheckpointUnlessTurnedOff) {
  const std::string dir = MakeTempDir("checkpoints");
  const std::string logs = MakeTempDir("logs");
  const std::vector<std::string> model = {"--synthetic", "llama:layers=1,hidden=64"};
  {
    std::vector<std::string> flags = model;
    flags.insert(flags.end(), {"--checkpoint-dir", dir, "--checkpoint-on-sigterm", "false"});
    auto processes = StartProcesses(1, flags);
    ASSERT_NE(processes, nullptr);
    ASSERT_NE(Connect(*processes), nullptr);
    EXPECT_EQ(processes->Stop(), absl::OkStatus());
    EXPECT_FALSE(std::filesystem::exists(dir + "/shard-0-of-1.safetensors"));
  }
  std::vector<std::string> flags = model;
  flags.insert(flags.end(), {"--checkpoint-dir", dir});
  auto processes = StartProcesses(1, flags, logs);
  ASSERT_NE(processes, nullptr);
  ASSERT_NE(Connect(*processes), nullptr);
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
  EXPECT_TRUE(std::filesystem::exists(dir + "/shard-0-of-1.safetensors"));
  EXPECT_THAT(ReadLog(logs, 0), AllOf(HasSubstr("received SIGTERM, draining"),
                                      HasSubstr("checkpoint version 0 written to")));
}

// Checkpoints taken while publishes commit each hold one version: the
// version they are labelled with, and exactly that version's values, under
// a checksum that matches. (Checkpoints read the master twice, without
// waiting for commits: 296 of 349 taken during a publish loop were torn or
// mislabelled, and a torn one kept the shard from starting.)
TEST(CheckpointTest, CheckpointsTakenDuringPublishesHoldOneVersionEach) {
  const std::string dir = MakeTempDir("checkpoints");
  // 7M parameters: a checkpoint takes long enough for commits to land in it.
  const std::string spec = "llama:layers=2,hidden=512,ffn=1536,vocab=64,seed=5";
  auto processes = StartProcesses(
      1, {"--synthetic", spec, "--policy", kPolicy, "--checkpoint-dir", dir, "--admin-token-file",
          WriteToken(dir), "--checkpoint-on-sigterm", "false"});
  ASSERT_NE(processes, nullptr);
  auto set = Connect(*processes);
  ASSERT_NE(set, nullptr);
  auto source = SyntheticModel::Create(spec);
  ASSERT_TRUE(source.ok()) << source.status();
  std::map<std::string, std::vector<float>> initial;
  for (uint32_t l = 0; l < (*source)->model().layers.size(); ++l) {
    for (uint32_t t = 0; t < (*source)->model().layers[l].tensors.size(); ++t) {
      const TensorSpec& tensor = (*source)->model().layers[l].tensors[t];
      std::vector<float>& values = initial[tensor.name];
      values.resize(tensor.num_elements);
      ASSERT_TRUE((*source)->Read(l, t, ElementRange{0, tensor.num_elements}, values).ok());
    }
  }
  // Version k holds every value times 1 + k/64.
  const auto values_at = [&initial](uint64_t k) {
    auto values = initial;
    for (auto& [name, tensor] : values) {
      for (float& value : tensor) value *= 1.0f + static_cast<float>(k) / 64;
    }
    return values;
  };
  constexpr uint64_t kVersions = 8;
  std::atomic<bool> published{false};
  std::thread publisher([&] {
    client::WeightPublisher publisher(*set, {.admin_token = kToken, .insecure = true});
    for (uint64_t k = 1; k <= kVersions; ++k) {
      const auto values = values_at(k);
      client::TensorValues view;
      for (const auto& [name, tensor] : values) view.emplace(name, tensor);
      const absl::StatusOr<client::PublishResult> result = publisher.Publish(view);
      EXPECT_TRUE(result.ok()) << result.status();
    }
    published = true;
  });
  auto admin = layercast::v1::ShardAdmin::NewStub(set->channel(0));
  // Checkpoints back to back while the publishes go on, each kept as a
  // copy (the next one replaces the file), checked once both are done.
  std::vector<std::pair<std::string, uint64_t>> copies;  // (file, version answered)
  while (!published.load() && copies.size() < 100) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    layercast::v1::CheckpointResponse response;
    const grpc::Status status = admin->Checkpoint(&context, {}, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const std::string copy = absl::StrCat(dir, "/copy-", copies.size(), ".safetensors");
    std::filesystem::copy_file(response.path(), copy);
    copies.emplace_back(copy, response.version());
  }
  publisher.join();
  std::printf("%zu checkpoints taken during %llu publishes\n", copies.size(),
              static_cast<unsigned long long>(kVersions));
  EXPECT_GE(copies.size(), 3u) << "too few checkpoints overlapped the publishes to show anything";
  for (size_t c = 0; c < copies.size(); ++c) {
    const auto& [copy, answered] = copies[c];
    auto checkpoint =
        server::CheckpointSource::Open(copy, (*source)->model(), 0, 1, *Policy::Parse(kPolicy));
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    const uint64_t version = (*checkpoint)->version();
    EXPECT_EQ(version, answered);
    const auto expected = values_at(version);
    for (uint32_t l = 0; l < (*source)->model().layers.size(); ++l) {
      for (uint32_t t = 0; t < (*source)->model().layers[l].tensors.size(); ++t) {
        const TensorSpec& tensor = (*source)->model().layers[l].tensors[t];
        std::vector<float> read(tensor.num_elements);
        ASSERT_TRUE((*checkpoint)->Read(l, t, ElementRange{0, tensor.num_elements}, read).ok());
        EXPECT_EQ(
            std::memcmp(read.data(), expected.at(tensor.name).data(), read.size() * sizeof(float)),
            0)
            << "checkpoint " << c << " labelled version " << version << ": " << tensor.name;
      }
    }
    EXPECT_TRUE((*checkpoint)->VerifyChecksum().ok()) << "checkpoint " << c;
    std::filesystem::remove(copy);
  }
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

// A second process started as the same shard on the same checkpoint
// directory (another port, a copied manifest) would write the same file:
// it refuses to start, naming the process that serves it.
TEST(CheckpointTest, ASecondShardOfTheSameIndexAndDirectoryRefusesToStart) {
  const std::string dir = MakeTempDir("checkpoints");
  const std::string spec = "llama:layers=1,hidden=64,seed=3";
  auto processes = StartProcesses(2, {"--synthetic", spec, "--checkpoint-dir", dir});
  ASSERT_NE(processes, nullptr);
  std::string output;
  EXPECT_EQ(RunShard(absl::StrCat("--shard-index 1 --num-shards 2 --synthetic ", spec,
                                  " --checkpoint-dir ", dir),
                     &output),
            2);
  EXPECT_THAT(output, HasSubstr(absl::StrCat("another live process (pid ", processes->pid(1),
                                             ") holds ", dir, "/shard-1.lock")));
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
  // Once it is gone (here stopped; a killed one's lock goes with it), the
  // shard starts.
  processes = StartProcesses(2, {"--synthetic", spec, "--checkpoint-dir", dir});
  ASSERT_NE(processes, nullptr);
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
}

TEST(CheckpointTest, CorruptOrMismatchedCheckpointsStopTheShardWithExitStatusTwo) {
  const std::string dir = MakeTempDir("checkpoints");
  const std::string spec = "llama:layers=1,hidden=64,seed=3";
  {
    auto processes = StartProcesses(2, {"--synthetic", spec, "--checkpoint-dir", dir});
    ASSERT_NE(processes, nullptr);
    ASSERT_NE(Connect(*processes), nullptr);
    EXPECT_EQ(processes->Stop(), absl::OkStatus());
  }
  const std::string file = dir + "/shard-1-of-2.safetensors";
  ASSERT_TRUE(std::filesystem::exists(file));
  std::string output;

  // Another model.
  EXPECT_EQ(RunShard(absl::StrCat("--shard-index 1 --num-shards 2 --synthetic ", spec,
                                  "0 --checkpoint-dir ", dir),
                     &output),
            2);
  EXPECT_THAT(output, AllOf(HasSubstr("layercast-shard: checkpoint " + file +
                                      " does not match this shard: it holds model"),
                            HasSubstr("seed=3'")));
  // Another shard count loads the set resharded, and needs all of it.
  const std::string other = dir + "/shard-0-of-2.safetensors";
  std::filesystem::rename(other, other + ".away");
  EXPECT_EQ(RunShard(absl::StrCat("--shard-index 1 --num-shards 3 --synthetic ", spec,
                                  " --checkpoint-dir ", dir),
                     &output),
            2);
  EXPECT_THAT(output, HasSubstr("checkpoint " + other +
                                " is missing: shard 1 of 3 loads the checkpoints 2 shards wrote"));
  std::filesystem::rename(other + ".away", other);
  // Another policy: a different layout.
  EXPECT_EQ(RunShard(absl::StrCat("--shard-index 1 --num-shards 2 --synthetic ", spec,
                                  " --policy p=f32,c=f16 --checkpoint-dir ", dir),
                     &output),
            2);
  EXPECT_THAT(output, AllOf(HasSubstr(file), HasSubstr("its layout digest is")));

  // One flipped bit in the data.
  {
    std::fstream bytes(file, std::ios::in | std::ios::out | std::ios::binary);
    bytes.seekg(-100, std::ios::end);
    char byte = 0;
    bytes.read(&byte, 1);
    byte ^= 0x10;
    bytes.seekp(-100, std::ios::end);
    bytes.write(&byte, 1);
  }
  EXPECT_EQ(RunShard(absl::StrCat("--shard-index 1 --num-shards 2 --synthetic ", spec,
                                  " --checkpoint-dir ", dir),
                     &output),
            2);
  EXPECT_THAT(output, HasSubstr("layercast-shard: checkpoint " + file +
                                " is corrupt: its data hashes to sha256:"));
  EXPECT_THAT(output, ::testing::Not(HasSubstr("ready"))) << "nothing may be served";
  // So is a shard of another count that reads from it: a block it reads
  // fails its CRC-32C.
  EXPECT_EQ(RunShard(absl::StrCat("--shard-index 1 --num-shards 3 --synthetic ", spec,
                                  " --checkpoint-dir ", dir),
                     &output),
            2);
  EXPECT_THAT(output,
              HasSubstr("layercast-shard: checkpoint " + file + " is corrupt: its data bytes ["));
  EXPECT_THAT(output, ::testing::Not(HasSubstr("ready"))) << "nothing may be served";
}

TEST(CheckpointTest, SigkillDuringALargeWriteLeavesThePreviousCheckpointWhole) {
  // About 350 MiB of fp32 on one shard: the write takes long enough to be
  // interrupted.
  const std::string spec = "llama:layers=2,hidden=1024,ffn=2816,vocab=32000,seed=5";
  const std::string dir = MakeTempDir("checkpoints");
  const std::string logs = MakeTempDir("logs");
  const std::string token = WriteToken(MakeTempDir("secret"));
  const std::vector<std::string> flags = {"--synthetic",        spec, "--checkpoint-dir", dir,
                                          "--admin-token-file", token};
  const std::string file = dir + "/shard-0-of-1.safetensors";

  auto processes = StartProcesses(1, flags);
  ASSERT_NE(processes, nullptr);
  const Gathered before = [&] {
    auto set = Connect(*processes);
    return set ? GatherAll(*set, /*hash_only=*/true) : Gathered();
  }();
  ASSERT_FALSE(before.empty());
  auto stub = layercast::v1::ShardAdmin::NewStub(
      grpc::CreateChannel(processes->addresses()[0], grpc::InsecureChannelCredentials()));
  const auto checkpoint = [&] {
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    layercast::v1::CheckpointResponse response;
    return stub->Checkpoint(&context, {}, &response);
  };
  const grpc::Status first = checkpoint();
  ASSERT_TRUE(first.ok()) << first.error_message();
  const uint64_t size = std::filesystem::file_size(file);
  ASSERT_GT(size, uint64_t{300} << 20);
  const std::string sha = Sha256Sum(file);

  // The second write is killed as soon as its temporary file has data. Its
  // name ends in a random nonce: find it by the shard's pid.
  const std::string prefix = absl::StrCat(".shard-0-of-1.safetensors.tmp-", processes->pid(0), "-");
  std::string temporary;
  grpc::Status second;
  std::thread writer([&] { second = checkpoint(); });
  const auto written = [&]() -> uint64_t {
    std::error_code error;  // none yet: file_size fails and says so
    for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
      if (entry.path().filename().string().rfind(prefix, 0) == 0) temporary = entry.path();
    }
    if (temporary.empty()) return 0;
    const uint64_t bytes = std::filesystem::file_size(temporary, error);
    return error ? 0 : bytes;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline && written() < (uint64_t{32} << 20)) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  processes->KillForTest(0);
  writer.join();
  EXPECT_EQ(second.error_code(), grpc::StatusCode::UNAVAILABLE) << second.error_message();
  ASSERT_TRUE(std::filesystem::exists(temporary)) << "the kill came before the rename";
  std::fprintf(stderr, "killed with %llu of %llu bytes in the temporary file\n",
               static_cast<unsigned long long>(written()), static_cast<unsigned long long>(size));
  EXPECT_EQ(std::filesystem::file_size(file), size);
  EXPECT_EQ(Sha256Sum(file), sha) << "the previous checkpoint changed";

  // A new process removes the torn temporary file, loads the checkpoint and
  // serves exactly what was served before.
  processes = StartProcesses(1, flags, logs);
  ASSERT_NE(processes, nullptr);
  auto set = Connect(*processes);
  ASSERT_NE(set, nullptr);
  const Gathered after = GatherAll(*set, /*hash_only=*/true);
  EXPECT_TRUE(after == before) << "gathered layers differ after loading the checkpoint";
  EXPECT_EQ(processes->Stop(), absl::OkStatus());
  EXPECT_FALSE(std::filesystem::exists(temporary));
  EXPECT_THAT(ReadLog(logs, 0), AllOf(HasSubstr("removed 1 temporary file(s)"),
                                      HasSubstr("loading checkpoint " + file)));
}

}  // namespace
}  // namespace layercast::testing
