#include "client/layer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "platform/byte_size.h"

namespace layercast::client {

namespace {

// Layers of 2 MiB and more get their own mapping backed by transparent huge
// pages where the kernel allows (madvise mode is common): filling a fresh
// 100 MiB layer otherwise costs 25,000 page faults, which measured as the
// worker's largest cost.
constexpr uint64_t kHugePage = 2 << 20;

// REQUIRES: bytes <= kMaxAssembledLayerBytes, so the rounding cannot wrap.
uint64_t MappedSize(uint64_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

absl::Status CannotAllocate(uint64_t bytes) {
  return absl::ResourceExhaustedError(
      absl::StrCat("cannot allocate ", bytes, " bytes (", FormatBytes(bytes),
                   ") of host memory for a layer: gather it in byte ranges, or on a host with "
                   "more memory"));
}

}  // namespace

absl::StatusOr<LayerBuffer> LayerBuffer::Allocate(uint64_t bytes,
                                                  std::function<void()> on_release) {
  if (bytes > kMaxAssembledLayerBytes) return CannotAllocate(bytes);
  LayerBuffer buffer;
  if (bytes >= kHugePage) {
    void* memory = mmap(nullptr, MappedSize(bytes), PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) return CannotAllocate(bytes);
    madvise(memory, MappedSize(bytes), MADV_HUGEPAGE);  // advice only: ignore failure
    buffer.data_ = static_cast<uint8_t*>(memory);
    buffer.mapped_ = true;
  } else {
    // aligned_alloc wants a multiple of the alignment; assembled sizes
    // already are, but round for callers with raw sizes.
    const uint64_t rounded =
        std::max<uint64_t>(1, (bytes + kAssembledAlignment - 1) / kAssembledAlignment) *
        kAssembledAlignment;
    buffer.data_ = static_cast<uint8_t*>(std::aligned_alloc(kAssembledAlignment, rounded));
    if (buffer.data_ == nullptr) return CannotAllocate(bytes);
  }
  buffer.size_ = bytes;
  buffer.on_release_ = std::move(on_release);
  return buffer;
}

LayerBuffer::LayerBuffer(LayerBuffer&& other) noexcept { *this = std::move(other); }

LayerBuffer& LayerBuffer::operator=(LayerBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, false);
    on_release_ = std::exchange(other.on_release_, {});
  }
  return *this;
}

LayerBuffer::~LayerBuffer() { Reset(); }

void LayerBuffer::Reset() {
  if (mapped_) {
    munmap(data_, MappedSize(size_));
  } else {
    std::free(data_);
  }
  mapped_ = false;
  data_ = nullptr;
  size_ = 0;
  if (on_release_) std::exchange(on_release_, {})();
}

Layer::TensorView Layer::tensor(size_t i) const {
  const TensorSpec& spec = spec_->tensors[i];
  const AssembledTensor& placed = layout_->tensors()[i];
  // The scales sit at an aligned offset of an aligned buffer: valid floats.
  const auto* scales = reinterpret_cast<const float*>(buffer_.data() + placed.scale_offset);
  return TensorView{
      spec.name,
      spec.shape,
      placed.compute_dtype,
      std::span<const uint8_t>(buffer_.data() + placed.byte_offset, placed.num_bytes()),
      placed.num_elements,
      placed.block_size,
      std::span<const float>(scales, placed.num_blocks())};
}

std::optional<Layer::TensorView> Layer::Find(absl::string_view name) const {
  for (size_t i = 0; i < spec_->tensors.size(); ++i) {
    if (spec_->tensors[i].name == name) return tensor(i);
  }
  return std::nullopt;
}

}  // namespace layercast::client
