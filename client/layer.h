#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "core/model.h"

namespace layercast::client {

// A block of host memory for one assembled layer, aligned to
// kAssembledAlignment. Whoever made it may attach a release hook (a memory
// budget returns its bytes there); the hook runs once, when the buffer dies.
// Move-only; not thread-safe.
class LayerBuffer {
 public:
  // Allocates `bytes` (uninitialised). `on_release` may be empty; it runs
  // only for a buffer that was made. RESOURCE_EXHAUSTED naming the size when
  // the memory cannot be had: a size a peer claimed is no reason to throw.
  static absl::StatusOr<LayerBuffer> Allocate(uint64_t bytes,
                                              std::function<void()> on_release = {});

  LayerBuffer() = default;
  LayerBuffer(LayerBuffer&&) noexcept;
  LayerBuffer& operator=(LayerBuffer&&) noexcept;
  ~LayerBuffer();

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  void Reset();
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool mapped_ = false;  // from mmap (huge pages) rather than aligned_alloc
  std::function<void()> on_release_;
};

// One gathered layer: every tensor in its compute dtype at its assembled
// offset, in one buffer. Owns the buffer; dropping the Layer frees it (and
// returns its bytes to whatever budget lent them). Move-only; const methods
// are thread-safe.
class Layer {
 public:
  struct TensorView {
    absl::string_view name;
    std::span<const int64_t> shape;
    DType dtype;
    std::span<const uint8_t> bytes;  // num_elements * DTypeSize(dtype), little-endian
    uint64_t num_elements;
    // 8-bit floats only (else 0 and empty): element i's value is
    // value(bytes[i]) * scales[i / block_size] (core/fp8.h DequantizeFp8).
    uint32_t block_size = 0;
    std::span<const float> scales;
  };

  // `spec` and `layout` describe `buffer`'s contents; `index` is the layer's
  // position in the model.
  Layer(uint32_t index, const LayerSpec* spec, const AssembledLayout* layout, uint64_t version,
        LayerBuffer buffer)
      : index_(index),
        spec_(spec),
        layout_(layout),
        version_(version),
        buffer_(std::move(buffer)) {}

  uint32_t index() const { return index_; }
  const std::string& name() const { return spec_->name; }
  // The parameter version every shard cast this layer from.
  uint64_t version() const { return version_; }
  size_t num_tensors() const { return spec_->tensors.size(); }
  TensorView tensor(size_t i) const;
  // nullopt when the layer has no tensor of that name.
  std::optional<TensorView> Find(absl::string_view name) const;
  // The whole assembled buffer, padding included.
  std::span<const uint8_t> bytes() const { return {buffer_.data(), buffer_.size()}; }

  // For a holder that updates the layer in place (ModelMirror): the buffer
  // to write into, and the version it then holds. Views already handed out
  // stay valid: the buffer never moves.
  std::span<uint8_t> mutable_bytes() { return {buffer_.data(), buffer_.size()}; }
  void set_version(uint64_t version) { version_ = version; }

 private:
  uint32_t index_;
  const LayerSpec* spec_;          // owned by the ShardSet
  const AssembledLayout* layout_;  // owned by the ShardSet
  uint64_t version_;
  LayerBuffer buffer_;
};

}  // namespace layercast::client
