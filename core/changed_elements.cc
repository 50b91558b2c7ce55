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

// Copies the elements [first, end) of one tensor's `size`-byte items.
void CopyItems(const uint8_t* from, uint8_t* to, uint64_t first, uint64_t end, size_t size) {
  std::memcpy(to + first * size, from + first * size, (end - first) * size);
}

// Copies the items of `from` whose bits `marked` sets, a run of set bits
// at a time (of `n` items of `size` bytes).
uint64_t CopyRuns(std::span<const uint64_t> marked, uint64_t n, size_t size, const uint8_t* from,
                  uint8_t* to) {
  uint64_t copied = 0;
  for (uint64_t w = 0; w < marked.size(); ++w) {
    uint64_t word = marked[w];
    while (word != 0) {
      const int begin = std::countr_zero(word);
      const int length = std::countr_one(word >> begin);
      const uint64_t first = w * 64 + static_cast<uint64_t>(begin);
      const uint64_t end = std::min(n, first + static_cast<uint64_t>(length));
      if (first >= end) return copied;
      CopyItems(from, to, first, end, size);
      copied += (end - first) * size;
      word = length + begin == 64 ? 0 : word & ~(((uint64_t{1} << length) - 1) << begin);
    }
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

uint64_t CopyChanged(const AssembledLayout& layout, const ChangedElements& changed,
                     const uint8_t* from, uint8_t* to) {
  uint64_t copied = 0;
  for (size_t t = 0; t < layout.tensors().size() && t < changed.elements.size(); ++t) {
    const AssembledTensor& tensor = layout.tensors()[t];
    copied += CopyRuns(changed.elements[t], tensor.num_elements, DTypeSize(tensor.compute_dtype),
                       from + tensor.byte_offset, to + tensor.byte_offset);
    if (tensor.block_size != 0 && t < changed.scales.size()) {
      copied += CopyRuns(changed.scales[t], Fp8BlockCount(tensor.num_elements, tensor.block_size),
                         sizeof(float), from + tensor.scale_offset, to + tensor.scale_offset);
    }
  }
  return copied;
}

}  // namespace layercast
