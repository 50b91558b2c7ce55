#include "core/changed_elements.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>

#include "core/dtype.h"
#include "core/fp8.h"

namespace layercast {
namespace {

void Or(std::span<uint64_t> bits, uint64_t word, uint64_t value) {
  if (value == 0 || word >= bits.size()) return;
  std::atomic_ref<uint64_t>(bits[word]).fetch_or(value, std::memory_order_relaxed);
}

// Collects marks one word at a time, so each word is written once.
class WordMarker {
 public:
  explicit WordMarker(std::span<uint64_t> bits) : bits_(bits) {}
  ~WordMarker() { Or(bits_, word_, value_); }
  void Mark(uint64_t bit) {
    if (bit / 64 != word_) {
      Or(bits_, word_, value_);
      word_ = bit / 64;
      value_ = 0;
    }
    value_ |= uint64_t{1} << (bit % 64);
  }

 private:
  std::span<uint64_t> bits_;
  uint64_t word_ = 0, value_ = 0;
};

constexpr uint64_t kBlockBytes = 4096;

// Whether any of `changed`'s bitmaps (each of tensor `t`, elements or
// scales by `scales`) marks an item in [first, end).
bool AnyMarked(std::span<const ChangedElements* const> changed, size_t t, bool scales,
               uint64_t first, uint64_t end) {
  for (const ChangedElements* marks : changed) {
    const std::vector<std::vector<uint64_t>>& all = scales ? marks->scales : marks->elements;
    if (t >= all.size()) continue;
    const std::vector<uint64_t>& bits = all[t];
    for (uint64_t w = first / 64; w < std::min<uint64_t>((end + 63) / 64, bits.size()); ++w) {
      uint64_t word = bits[w];
      if (w == first / 64) word &= ~uint64_t{0} << (first % 64);
      if (w == end / 64 && end % 64 != 0) word &= (uint64_t{1} << (end % 64)) - 1;
      if (word != 0) return true;
    }
  }
  return false;
}

// Copies the `n` items of `size` bytes of one tensor's bitmaps (elements,
// or scales by `scales`) a block at a time where any is marked.
uint64_t CopyBlocks(std::span<const ChangedElements* const> changed, size_t t, bool scales,
                    uint64_t n, size_t size, const uint8_t* from, uint8_t* to) {
  // A multiple of 64 items, so a block's marks are whole words.
  const uint64_t per_block = std::max<uint64_t>(64, kBlockBytes / size / 64 * 64);
  uint64_t copied = 0;
  for (uint64_t first = 0; first < n; first += per_block) {
    const uint64_t end = std::min(n, first + per_block);
    if (!AnyMarked(changed, t, scales, first, end)) continue;
    std::memcpy(to + first * size, from + first * size, (end - first) * size);
    copied += (end - first) * size;
  }
  return copied;
}

}  // namespace

ChangedElements ChangedElements::For(const AssembledLayout& layout) {
  ChangedElements changed(layout.tensors().size());
  for (size_t t = 0; t < layout.tensors().size(); ++t) {
    const AssembledTensor& tensor = layout.tensors()[t];
    changed.elements[t].assign((tensor.num_elements + 63) / 64, 0);
    if (tensor.block_size != 0) {
      changed.scales[t].assign((Fp8BlockCount(tensor.num_elements, tensor.block_size) + 63) / 64,
                               0);
    }
  }
  return changed;
}

void ChangedElements::Add(const ChangedElements& other) {
  const auto add = [](const std::vector<uint64_t>& from, std::vector<uint64_t>& into) {
    if (into.size() < from.size()) into.resize(from.size(), 0);
    for (size_t w = 0; w < from.size(); ++w) into[w] |= from[w];
  };
  if (elements.size() < other.elements.size()) {
    elements.resize(other.elements.size());
    scales.resize(other.elements.size());
  }
  for (size_t t = 0; t < other.elements.size(); ++t) {
    add(other.elements[t], elements[t]);
    add(other.scales[t], scales[t]);
  }
}

uint64_t ChangedElements::Count() const {
  uint64_t count = 0;
  for (const std::vector<std::vector<uint64_t>>* all : {&elements, &scales}) {
    for (const std::vector<uint64_t>& bits : *all) {
      for (const uint64_t word : bits) count += static_cast<uint64_t>(std::popcount(word));
    }
  }
  return count;
}

void MarkRange(std::span<uint64_t> bits, uint64_t first, uint64_t count) {
  const uint64_t end = std::min<uint64_t>(first + count, bits.size() * 64);
  for (uint64_t at = first; at < end;) {
    const uint64_t word = at / 64, shift = at % 64;
    const uint64_t take = std::min<uint64_t>(64 - shift, end - at);
    const uint64_t ones = take == 64 ? ~uint64_t{0} : ((uint64_t{1} << take) - 1);
    Or(bits, word, ones << shift);
    at += take;
  }
}

void MarkBitmap(std::span<uint64_t> bits, uint64_t first, std::span<const uint8_t> bitmap) {
  WordMarker marker(bits);
  for (uint64_t b = 0; b < bitmap.size(); ++b) {
    for (uint8_t byte = bitmap[b]; byte != 0; byte &= static_cast<uint8_t>(byte - 1)) {
      marker.Mark(first + b * 8 + static_cast<uint64_t>(std::countr_zero(byte)));
    }
  }
}

void MarkIndices(std::span<uint64_t> bits, uint64_t first, std::span<const uint64_t> indices) {
  WordMarker marker(bits);
  for (const uint64_t i : indices) marker.Mark(first + i);
}

uint64_t CopyChanged(const AssembledLayout& layout, std::span<const ChangedElements* const> changed,
                     const uint8_t* from, uint8_t* to) {
  uint64_t copied = 0;
  for (size_t t = 0; t < layout.tensors().size(); ++t) {
    const AssembledTensor& tensor = layout.tensors()[t];
    copied += CopyBlocks(changed, t, /*scales=*/false, tensor.num_elements,
                         DTypeSize(tensor.compute_dtype), from + tensor.byte_offset,
                         to + tensor.byte_offset);
    if (tensor.block_size != 0) {
      copied += CopyBlocks(changed, t, /*scales=*/true,
                           Fp8BlockCount(tensor.num_elements, tensor.block_size), sizeof(float),
                           from + tensor.scale_offset, to + tensor.scale_offset);
    }
  }
  return copied;
}

}  // namespace layercast
