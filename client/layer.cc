#include "client/layer.h"

#include <cstdlib>
#include <new>

namespace layercast::client {

LayerBuffer LayerBuffer::Allocate(uint64_t bytes, std::function<void()> on_release) {
  LayerBuffer buffer;
  // aligned_alloc wants a size that is a multiple of the alignment; assembled
  // sizes already are, but round anyway for callers with raw sizes.
  const uint64_t rounded =
      (bytes + kAssembledAlignment - 1) / kAssembledAlignment * kAssembledAlignment;
  buffer.data_ = static_cast<uint8_t*>(std::aligned_alloc(kAssembledAlignment, rounded ? rounded : kAssembledAlignment));
  if (buffer.data_ == nullptr) throw std::bad_alloc();
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
    on_release_ = std::exchange(other.on_release_, {});
  }
  return *this;
}

LayerBuffer::~LayerBuffer() { Reset(); }

void LayerBuffer::Reset() {
  std::free(data_);
  data_ = nullptr;
  size_ = 0;
  if (on_release_) std::exchange(on_release_, {})();
}

Layer::TensorView Layer::tensor(size_t i) const {
  const TensorSpec& spec = spec_->tensors[i];
  const AssembledTensor& placed = layout_->tensors()[i];
  return TensorView{spec.name, spec.shape, placed.compute_dtype,
                    std::span<const uint8_t>(buffer_.data() + placed.byte_offset, placed.num_bytes()),
                    placed.num_elements};
}

std::optional<Layer::TensorView> Layer::Find(absl::string_view name) const {
  for (size_t i = 0; i < spec_->tensors.size(); ++i) {
    if (spec_->tensors[i].name == name) return tensor(i);
  }
  return std::nullopt;
}

}  // namespace layercast::client
