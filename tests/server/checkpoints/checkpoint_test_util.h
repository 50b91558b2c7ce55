#pragma once

// Helpers for the checkpoint tests: a small model with awkward sizes whose
// values can be shifted (same layout, different data), and a file system that
// fails or "crashes" at a chosen operation.

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/parameter_source.h"
#include "core/policy.h"
#include "platform/file_system.h"
#include "server/serving/parameter_store.h"

namespace layercast::server::testing {

// Three layers, including tensors smaller than the shard count (so some
// shards own none of them) and one of 2^20 + 3 elements (several Appends).
// Element k of tensor t holds a pure function of (t, k) plus `delta`.
class ShiftedSource final : public ParameterSource {
 public:
  explicit ShiftedSource(float delta, std::string model_id = "ckpt-test-model");
  const ModelSpec& model() const override { return model_; }
  absl::Status Read(uint32_t layer, uint32_t tensor, ElementRange range,
                    std::span<float> dst) const override;
  // The value Read() gives element `index` of tensor `tensor` of `layer`.
  float Value(uint32_t layer, uint32_t tensor, uint64_t index) const;

 private:
  ModelSpec model_;
  float delta_;
};

inline Policy TestPolicy() { return *Policy::Parse("p=f32,c=bf16;*norm*=f32"); }

// Loads shard `shard` of `num_shards` of `source`; fails the test on error.
std::unique_ptr<ParameterStore> LoadStore(const ParameterSource& source, uint32_t shard,
                                          uint32_t num_shards, const Policy& policy = TestPolicy());

// True if every owned element of `store` equals `source`'s, bit for bit.
::testing::AssertionResult SameValues(const ParameterStore& store, const ShiftedSource& source);

// The bytes of a file (empty if it cannot be read).
std::string ReadFileBytes(const std::string& path);

// A fresh, empty directory for the current test.
std::string FreshDir(const std::string& name);

// Wraps the real file system. Counts the operations a checkpoint write makes
// (CreatePrivate, OpenForRead, every Append, Sync, Close, Rename, SyncDir;
// OpenForWrite too) and
// makes operation number `fail_at` (0-based) fail. kError: that one fails,
// the rest work (the writer can clean up). kCrash: that one and everything
// after fails, as if the process died there; a crashing Append writes half
// its bytes first (a torn write).
class FaultyFileSystem final : public FileSystem {
 public:
  enum class Mode { kError, kCrash };
  static constexpr int64_t kNever = -1;

  FaultyFileSystem(int64_t fail_at, Mode mode) : fail_at_(fail_at), mode_(mode) {}

  int64_t operations() const { return operations_; }
  bool renamed() const { return renamed_; }
  bool crashed() const { return crashed_; }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override;
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const std::string& path) override;
  absl::StatusOr<std::unique_ptr<WritableFile>> CreatePrivate(const std::string& path) override;
  absl::Status Rename(const std::string& from, const std::string& to) override;
  absl::Status SyncDir(const std::string& dir) override;
  absl::Status Remove(const std::string& path) override;
  bool Exists(const std::string& path) override;

  // Counts one operation; the fault to inject, or OK. Used by the files.
  absl::Status Step(const std::string& what);
  bool crashed_now() const { return crashed_; }

 private:
  FileSystem& real_ = DefaultFileSystem();
  const int64_t fail_at_;
  const Mode mode_;
  int64_t operations_ = 0;
  bool renamed_ = false;
  bool crashed_ = false;
};

}  // namespace layercast::server::testing
