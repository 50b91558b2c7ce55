#include "tests/server/checkpoints/checkpoint_test_util.h"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace layercast::server::testing {
namespace {

TensorSpec Tensor(std::string name, std::vector<int64_t> shape) {
  uint64_t elements = 1;
  for (int64_t dim : shape) elements *= static_cast<uint64_t>(dim);
  return TensorSpec{std::move(name), std::move(shape), elements};
}

class FaultyWritableFile final : public WritableFile {
 public:
  FaultyWritableFile(std::unique_ptr<WritableFile> real, FaultyFileSystem& fs)
      : real_(std::move(real)), fs_(fs) {}

  absl::Status Append(std::span<const uint8_t> data) override {
    absl::Status step = fs_.Step("append");
    if (absl::IsInternal(step) && fs_.crashed_now()) {
      (void)real_->Append(data.first(data.size() / 2));  // torn: half reaches the file
    }
    if (!step.ok()) return step;
    return real_->Append(data);
  }
  absl::Status Sync() override {
    if (absl::Status step = fs_.Step("sync"); !step.ok()) return step;
    return real_->Sync();
  }
  absl::Status Close() override {
    if (absl::Status step = fs_.Step("close"); !step.ok()) return step;
    return real_->Close();
  }

 private:
  std::unique_ptr<WritableFile> real_;
  FaultyFileSystem& fs_;
};

}  // namespace

ShiftedSource::ShiftedSource(float delta, std::string model_id) : delta_(delta) {
  model_.model_id = std::move(model_id);
  model_.layers.push_back({"embed", {Tensor("embed.weight", {97, 31})}});
  model_.layers.push_back(
      {"block.0",
       {Tensor("block.0.norm.weight", {1}), Tensor("block.0.big.weight", {(1 << 20) + 3}),
        Tensor("block.0.scale", {})}});
  model_.layers.push_back({"final", {Tensor("final.head.weight", {7, 13})}});
}

float ShiftedSource::Value(uint32_t layer, uint32_t tensor, uint64_t index) const {
  const uint64_t mixed = (layer * 131 + tensor * 17 + index * 2654435761ull) % 100003;
  return static_cast<float>(mixed) * 1e-3f - 50.0f + delta_;
}

absl::Status ShiftedSource::Read(uint32_t layer, uint32_t tensor, ElementRange range,
                                 std::span<float> dst) const {
  for (uint64_t i = 0; i < range.size(); ++i) dst[i] = Value(layer, tensor, range.begin + i);
  return absl::OkStatus();
}

std::unique_ptr<ParameterStore> LoadStore(const ParameterSource& source, uint32_t shard,
                                          uint32_t num_shards, const Policy& policy) {
  auto store = ParameterStore::Load(source, shard, num_shards, policy);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

::testing::AssertionResult SameValues(const ParameterStore& store, const ShiftedSource& source) {
  const ModelSpec& model = store.model();
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    for (uint32_t t = 0; t < model.layers[l].tensors.size(); ++t) {
      const ElementRange owned = store.owned(l, t);
      for (uint64_t i = 0; i < owned.size(); ++i) {
        const float expected = source.Value(l, t, owned.begin + i);
        const float actual = store.master(l, t)[i];
        if (std::memcmp(&expected, &actual, sizeof(float)) != 0) {
          return ::testing::AssertionFailure()
                 << model.layers[l].tensors[t].name << " element " << owned.begin + i << " is "
                 << actual << ", expected " << expected;
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

std::string ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

std::string FreshDir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("layercast-ckpt-", getpid()) /
      absl::StrCat(info->test_suite_name(), ".", info->name(), ".", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

absl::Status FaultyFileSystem::Step(const std::string& what) {
  if (crashed_) return absl::UnavailableError("the process has crashed");
  const int64_t n = operations_++;
  if (n != fail_at_) return absl::OkStatus();
  if (mode_ == Mode::kCrash) crashed_ = true;
  return absl::InternalError(absl::StrCat("injected fault at operation ", n, " (", what, ")"));
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> FaultyFileSystem::OpenForRead(
    const std::string& path) {
  if (absl::Status step = Step("open for read"); !step.ok()) return step;
  return real_.OpenForRead(path);
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultyFileSystem::OpenForWrite(
    const std::string& path) {
  if (absl::Status step = Step("open for write"); !step.ok()) return step;
  absl::StatusOr<std::unique_ptr<WritableFile>> file = real_.OpenForWrite(path);
  if (!file.ok()) return file.status();
  return std::unique_ptr<WritableFile>(
      std::make_unique<FaultyWritableFile>(*std::move(file), *this));
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultyFileSystem::CreatePrivate(
    const std::string& path) {
  if (absl::Status step = Step("create private"); !step.ok()) return step;
  absl::StatusOr<std::unique_ptr<WritableFile>> file = real_.CreatePrivate(path);
  if (!file.ok()) return file.status();
  return std::unique_ptr<WritableFile>(
      std::make_unique<FaultyWritableFile>(*std::move(file), *this));
}

absl::Status FaultyFileSystem::Rename(const std::string& from, const std::string& to) {
  if (absl::Status step = Step("rename"); !step.ok()) return step;
  absl::Status renamed = real_.Rename(from, to);
  renamed_ = renamed.ok();
  return renamed;
}

absl::Status FaultyFileSystem::SyncDir(const std::string& dir) {
  if (absl::Status step = Step("sync dir"); !step.ok()) return step;
  return real_.SyncDir(dir);
}

absl::Status FaultyFileSystem::Remove(const std::string& path) {
  if (crashed_) return absl::UnavailableError("the process has crashed");
  return real_.Remove(path);
}

bool FaultyFileSystem::Exists(const std::string& path) { return real_.Exists(path); }

}  // namespace layercast::server::testing
