#include "core/layout.h"

#include <openssl/evp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast {
namespace {

// "N bytes (X TiB)", or "more than 2^64 bytes" when the figure wrapped.
std::string DescribeBytes(uint64_t bytes, bool overflowed) {
  if (overflowed) return "more than 2^64 bytes";
  return absl::StrCat(bytes, " bytes (", FormatBytes(bytes), ")");
}

std::string DescribeCap() {
  return absl::StrCat("the most one layer may assemble to, ", kMaxAssembledLayerBytes, " bytes (",
                      FormatBytes(kMaxAssembledLayerBytes), ")");
}

}  // namespace

ElementRange ShardElementRange(uint64_t n, uint32_t shard, uint32_t num_shards) {
  // n*i/N computed as (n/N)*i + (n%N)*i/N, which is exact and cannot
  // overflow for any n (the second product is below N^2 <= 2^64).
  const uint64_t quotient = n / num_shards, remainder = n % num_shards;
  const auto bound = [&](uint64_t i) { return quotient * i + remainder * i / num_shards; };
  return ElementRange{bound(shard), bound(shard + 1)};
}

ElementRange Intersect(ElementRange a, ElementRange b) {
  const uint64_t begin = std::max(a.begin, b.begin);
  const uint64_t end = std::min(a.end, b.end);
  return end > begin ? ElementRange{begin, end} : ElementRange{begin, begin};
}

absl::StatusOr<AssembledLayout> AssembledLayout::Build(const LayerSpec& layer,
                                                       const Policy& policy) {
  std::vector<DType> dtypes;
  std::vector<uint64_t> counts;
  for (const TensorSpec& tensor : layer.tensors) {
    dtypes.push_back(policy.ComputeDTypeFor(tensor.name));
    counts.push_back(tensor.num_elements);
  }
  absl::StatusOr<AssembledLayout> layout = FromDTypes(dtypes, counts, policy.fp8_block());
  if (!layout.ok()) {
    return absl::Status(layout.status().code(),
                        absl::StrCat("layer ", layer.name, ": ", layout.status().message()));
  }
  return layout;
}

absl::StatusOr<AssembledLayout> AssembledLayout::FromDTypes(
    const std::vector<DType>& dtypes, const std::vector<uint64_t>& num_elements,
    uint32_t fp8_block) {
  if (dtypes.size() != num_elements.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layout needs one dtype per element count: ", dtypes.size(), " dtypes for ",
                     num_elements.size(), " element counts"));
  }
  // The counts may come from a forged manifest: a product or sum that wraps
  // would give a small buffer with tensors pointing far outside it. Every
  // step is checked against 2^64 and then against the cap, so the running
  // offset stays at most kMaxAssembledLayerBytes.
  AssembledLayout layout;
  uint64_t offset = 0;
  // Places `bytes` more at `offset` and moves it to the next aligned offset
  // after them, or says why they do not fit.
  const auto place = [&](size_t i, uint64_t bytes, bool bytes_wrapped,
                         absl::string_view what) -> absl::Status {
    if (bytes_wrapped || bytes > kMaxAssembledLayerBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", i, " of ", dtypes.size(), " has ", num_elements[i], " ", DTypeName(dtypes[i]),
          " elements, ", what, DescribeBytes(bytes, bytes_wrapped), ", more than ", DescribeCap()));
    }
    // AlignUp(offset + bytes), each step checked.
    uint64_t end = 0;
    const bool end_wrapped = __builtin_add_overflow(offset, bytes, &end) ||
                             __builtin_add_overflow(end, kAssembledAlignment - 1, &end);
    end = end / kAssembledAlignment * kAssembledAlignment;
    if (end_wrapped || end > kMaxAssembledLayerBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensors 0-", i, " of ", dtypes.size(), " take ",
                       DescribeBytes(end, end_wrapped), " (tensor ", i, " adds ", what, bytes,
                       " bytes at offset ", offset, "), more than ", DescribeCap()));
    }
    offset = end;
    return absl::OkStatus();
  };
  for (size_t i = 0; i < dtypes.size(); ++i) {
    AssembledTensor tensor{dtypes[i], offset, num_elements[i]};
    uint64_t bytes = 0;
    const bool bytes_wrapped = __builtin_mul_overflow(
        tensor.num_elements, static_cast<uint64_t>(DTypeSize(tensor.compute_dtype)), &bytes);
    RETURN_IF_ERROR(place(i, bytes, bytes_wrapped, ""));
    if (IsFloat8(tensor.compute_dtype)) {
      if (!IsValidFp8Block(fp8_block)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", i, " is ", DTypeName(tensor.compute_dtype), " with blocks of ", fp8_block,
            " elements; a block is a power of two from ", kMinFp8Block, " to ", kMaxFp8Block));
      }
      tensor.block_size = fp8_block;
      tensor.scale_offset = offset;
      // At most 4 bytes per element: the values' check bounds it.
      RETURN_IF_ERROR(place(i, tensor.scale_bytes(), false, "in block scales "));
    }
    layout.tensors_.push_back(tensor);
  }
  layout.total_bytes_ = offset;
  return layout;
}

absl::StatusOr<AssembledLayout> GradientLayout(const AssembledLayout& served) {
  std::vector<DType> dtypes;
  std::vector<uint64_t> counts;
  for (const AssembledTensor& tensor : served.tensors()) {
    dtypes.push_back(IsFloat8(tensor.compute_dtype) ? DType::kFloat32 : tensor.compute_dtype);
    counts.push_back(tensor.num_elements);
  }
  return AssembledLayout::FromDTypes(dtypes, counts);
}

absl::StatusOr<AssembledLayout> LayoutIn(const AssembledLayout& served, DType dtype,
                                         uint32_t fp8_block) {
  std::vector<uint64_t> counts;
  for (const AssembledTensor& tensor : served.tensors()) counts.push_back(tensor.num_elements);
  return AssembledLayout::FromDTypes(std::vector<DType>(counts.size(), dtype), counts, fp8_block);
}

absl::StatusOr<std::vector<TensorElementRange>> AssembledLayout::MapByteRange(uint64_t begin,
                                                                              uint64_t end) const {
  if (begin >= end || end > total_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte range [", begin, ", ", end, ") is not a non-empty range within the ",
                     "layer's assembled size of ", total_bytes_, " bytes"));
  }
  std::vector<TensorElementRange> out;
  for (uint32_t t = 0; t < tensors_.size(); ++t) {
    const AssembledTensor& tensor = tensors_[t];
    const uint64_t size = DTypeSize(tensor.compute_dtype);
    // Cannot wrap: FromDTypes kept every tensor's end within
    // kMaxAssembledLayerBytes.
    const uint64_t tensor_end = tensor.byte_offset + tensor.num_bytes();
    const uint64_t lo = std::max(begin, tensor.byte_offset);
    const uint64_t hi = std::min(end, tensor_end);
    if (lo >= hi) continue;
    if ((lo - tensor.byte_offset) % size != 0 || (hi - tensor.byte_offset) % size != 0) {
      const uint64_t bad = (lo - tensor.byte_offset) % size != 0 ? lo : hi;
      return absl::InvalidArgumentError(absl::StrCat(
          "byte range [", begin, ", ", end, ") splits an element: byte ", bad, " falls inside a ",
          DTypeName(tensor.compute_dtype), " element of tensor ", t,
          "; range ends must be multiples of ", size, " bytes from the tensor's offset ",
          tensor.byte_offset, " (any multiple of ", kAssembledAlignment, " is always valid)"));
    }
    out.push_back(TensorElementRange{
        t, ElementRange{(lo - tensor.byte_offset) / size, (hi - tensor.byte_offset) / size}});
  }
  return out;
}

std::vector<std::pair<uint64_t, uint64_t>> AssembledLayout::SplitBytes(uint32_t parts) const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  const uint64_t units = total_bytes_ / kAssembledAlignment;
  for (uint32_t i = 0; i < parts; ++i) {
    const ElementRange unit_range = ShardElementRange(units, i, parts);
    out.emplace_back(unit_range.begin * kAssembledAlignment, unit_range.end * kAssembledAlignment);
  }
  return out;
}

absl::Status CheckBlocksWithinShards(const LayerSpec& layer, const AssembledLayout& layout,
                                     uint32_t num_shards) {
  for (size_t t = 0; t < layer.tensors.size(); ++t) {
    const AssembledTensor& placed = layout.tensors()[t];
    if (placed.block_size == 0) continue;
    const uint64_t n = placed.num_elements;
    for (uint32_t shard = 1; shard < num_shards; ++shard) {
      const uint64_t begin = ShardElementRange(n, shard, num_shards).begin;
      if (begin % placed.block_size == 0) continue;
      const std::string& name = layer.tensors[t].name;
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", name, " (", n, " elements) is ", DTypeName(placed.compute_dtype),
          " in blocks of ", placed.block_size, ", but shard ", shard, " of ", num_shards,
          " would start at element ", begin,
          ", inside a block: each shard quantizes its own blocks, so every shard's slice must "
          "start on a block boundary. Override the tensor to a 16-bit dtype, before any override "
          "that matches it (e.g. ';",
          name,
          "=bfloat16'), or choose a shard count or fp8_block for which n*i/N is a multiple of "
          "the block"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AssembledLayout>> ShardedLayouts(const ModelSpec& model,
                                                            const Policy& policy,
                                                            uint32_t num_shards) {
  std::vector<AssembledLayout> layouts;
  layouts.reserve(model.layers.size());
  for (const LayerSpec& layer : model.layers) {
    ASSIGN_OR_RETURN(AssembledLayout layout, AssembledLayout::Build(layer, policy));
    RETURN_IF_ERROR(CheckBlocksWithinShards(layer, layout, num_shards));
    layouts.push_back(std::move(layout));
  }
  return layouts;
}

absl::StatusOr<std::array<uint8_t, 32>> LayoutDigest(const ModelSpec& model, const Policy& policy) {
  // A length-prefixed serialisation, so no two different layouts hash the
  // same bytes.
  std::string bytes;
  const auto append_u64 = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(v >> (8 * i)));
  };
  const auto append_str = [&](absl::string_view s) {
    append_u64(s.size());
    bytes.append(s.data(), s.size());
  };
  append_u64(model.layers.size());
  for (const LayerSpec& layer : model.layers) {
    append_str(layer.name);
    ASSIGN_OR_RETURN(const AssembledLayout layout, AssembledLayout::Build(layer, policy));
    append_u64(layer.tensors.size());
    append_u64(layout.total_bytes());
    for (size_t t = 0; t < layer.tensors.size(); ++t) {
      const TensorSpec& spec = layer.tensors[t];
      const AssembledTensor& placed = layout.tensors()[t];
      append_str(spec.name);
      append_u64(spec.shape.size());
      for (int64_t dim : spec.shape) append_u64(static_cast<uint64_t>(dim));
      append_u64(static_cast<uint64_t>(placed.compute_dtype));
      append_u64(placed.byte_offset);
      append_u64(placed.num_elements);
      if (IsFloat8(placed.compute_dtype)) {
        append_u64(placed.block_size);
        append_u64(placed.scale_offset);
      }
    }
  }
  std::array<uint8_t, 32> digest{};
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest.data(), &length, EVP_sha256(), nullptr);
  return digest;
}

}  // namespace layercast
