#include "server/casting/cast_cache.h"

#include <new>
#include <utility>

#include "core/crc32c.h"
#include "core/dtype.h"
#include "server/serving/fetch_plan.h"

namespace layercast::server {
namespace {

bool Kept(const AssembledTensor& tensor, ElementRange owned) {
  return tensor.block_size == 0 && owned.size() > 0;
}

std::vector<uint64_t> AllLayerBytes(absl::Span<const AssembledLayout> layouts,
                                    const CastCache::Options& options) {
  std::vector<uint64_t> bytes;
  bytes.reserve(layouts.size());
  for (const AssembledLayout& layout : layouts) {
    bytes.push_back(CastCache::LayerBytes(layout, options.shard_index, options.num_shards));
  }
  return bytes;
}

}  // namespace

uint64_t CastCache::LayerBytes(const AssembledLayout& layout, uint32_t shard_index,
                               uint32_t num_shards) {
  uint64_t bytes = 0;
  for (const AssembledTensor& tensor : layout.tensors()) {
    const ElementRange owned = ShardElementRange(tensor.num_elements, shard_index, num_shards);
    if (Kept(tensor, owned)) bytes += owned.size() * DTypeSize(tensor.compute_dtype);
  }
  return bytes;
}

bool CastCache::Admits(uint64_t held, uint64_t bytes, uint64_t capacity,
                       std::optional<uint64_t> budget, uint64_t in_use) {
  if (bytes == 0 || bytes > capacity || held > capacity - bytes) return false;
  if (!budget) return true;
  return in_use <= *budget && (*budget - in_use) / 2 >= bytes;
}

CastCache::CastCache(Options options, absl::Span<const AssembledLayout> layouts,
                     MemoryBudget& budget, ServerMetrics& metrics)
    : options_(options),
      layouts_(layouts),
      budget_(budget),
      metrics_(metrics),
      layer_bytes_(AllLayerBytes(layouts, options)),
      layers_(layouts.size()) {}

CastCache::~CastCache() { DropAll(); }

std::shared_ptr<CastCache::Layer> CastCache::ForVersion(uint32_t layer, uint64_t version) {
  if (layer >= layer_bytes_.size()) return nullptr;
  const uint64_t bytes = layer_bytes_[layer];
  std::shared_ptr<Layer> superseded;  // let go after the lock: it returns its budget
  absl::MutexLock lock(&mu_);
  if (const std::shared_ptr<Layer>& held = layers_[layer]; held != nullptr) {
    if (held->version() == version) return held;
    if (held->version() > version) return nullptr;
    superseded = TakeLocked(layer);
  }
  if (!Admits(held_bytes_, bytes, options_.capacity_bytes, budget_.budget(), budget_.in_use()) ||
      !budget_.TryAcquire(bytes)) {
    PublishLocked();
    return nullptr;
  }
  try {
    layers_[layer] =
        std::make_shared<Layer>(layer, layouts_[layer], options_, version, bytes, budget_);
  } catch (const std::bad_alloc&) {
    budget_.Release(bytes);
    PublishLocked();
    return nullptr;
  }
  held_bytes_ += bytes;
  ++held_layers_;
  PublishLocked();
  return layers_[layer];
}

std::shared_ptr<CastCache::Layer> CastCache::TakeLocked(uint32_t layer) {
  std::shared_ptr<Layer> taken = std::move(layers_[layer]);
  if (taken != nullptr) {
    held_bytes_ -= taken->bytes();
    --held_layers_;
  }
  return taken;
}

void CastCache::PublishLocked() {
  metrics_.cast_cache_bytes().Set(static_cast<double>(held_bytes_));
  metrics_.cast_cache_layers().Set(static_cast<double>(held_layers_));
}

void CastCache::DropLayer(uint32_t layer) {
  std::shared_ptr<Layer> dropped;
  absl::MutexLock lock(&mu_);
  if (layer >= layers_.size()) return;
  dropped = TakeLocked(layer);
  PublishLocked();
}

void CastCache::DropAll() {
  std::vector<std::shared_ptr<Layer>> dropped;
  absl::MutexLock lock(&mu_);
  for (uint32_t layer = 0; layer < layers_.size(); ++layer) {
    if (std::shared_ptr<Layer> taken = TakeLocked(layer)) dropped.push_back(std::move(taken));
  }
  PublishLocked();
}

uint64_t CastCache::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

size_t CastCache::held_layers() const {
  absl::MutexLock lock(&mu_);
  return held_layers_;
}

CastCache::Layer::Layer(uint32_t layer, const AssembledLayout& layout, const Options& options,
                        uint64_t version, uint64_t bytes, MemoryBudget& budget)
    : layer_(layer), version_(version), bytes_(bytes), budget_(budget) {
  uint64_t offset = 0, cells = 0;
  for (const AssembledTensor& placed : layout.tensors()) {
    Tensor tensor;
    tensor.owned = ShardElementRange(placed.num_elements, options.shard_index, options.num_shards);
    tensor.kept = Kept(placed, tensor.owned);
    tensor.dtype = placed.compute_dtype;
    if (tensor.kept) {
      tensor.per_chunk = ElementsPerChunk(options.chunk_bytes, placed);
      tensor.offset = offset;
      tensor.first_cell = cells;
      offset += tensor.owned.size() * DTypeSize(tensor.dtype);
      cells += ChunkGrid(options.chunk_bytes, placed, tensor.owned).chunks();
    }
    tensors_.push_back(tensor);
  }
  // Not value-initialised: every byte is cast before it is served, and
  // pages untouched until then cost nothing.
  data_.reset(new uint8_t[offset]);
  cells_ = std::make_unique<std::atomic<uint8_t>[]>(cells);
  crcs_ = std::make_unique<uint32_t[]>(cells);
}

// Charged by the cache that made it; whoever lets it go last gives it back.
CastCache::Layer::~Layer() { budget_.Release(bytes_); }

const CastCache::Layer::Tensor* CastCache::Layer::TensorOf(const ChunkKey& key) const {
  if (key.layer != layer_ || key.version != version_ || key.base_version != ChunkKey::kWhole ||
      key.tensor >= tensors_.size() || key.elements == 0) {
    return nullptr;
  }
  const Tensor& tensor = tensors_[key.tensor];
  if (!tensor.kept || key.dtype != tensor.dtype || key.element_begin < tensor.owned.begin ||
      key.element_begin + key.elements > tensor.owned.end) {
    return nullptr;
  }
  return &tensor;
}

grpc::Slice CastCache::Layer::SliceOf(uint64_t offset, uint64_t size) const {
  auto* holder = new std::shared_ptr<const Layer>(shared_from_this());
  return grpc::Slice(
      data_.get() + offset, size,
      [](void* held) { delete static_cast<std::shared_ptr<const Layer>*>(held); }, holder);
}

std::optional<CastChunk> CastCache::Layer::Find(const ChunkKey& key) const {
  const Tensor* tensor = TensorOf(key);
  if (tensor == nullptr) return std::nullopt;
  const uint64_t skip = key.element_begin - tensor->owned.begin;
  const uint64_t first = tensor->first_cell + skip / tensor->per_chunk;
  const uint64_t last = tensor->first_cell + (skip + key.elements - 1) / tensor->per_chunk;
  for (uint64_t cell = first; cell <= last; ++cell) {
    if (cells_[cell].load(std::memory_order_acquire) != kFilled) return std::nullopt;
  }
  const size_t size = DTypeSize(tensor->dtype);
  const uint64_t offset = tensor->offset + skip * size;
  const uint64_t bytes = key.elements * size;
  const bool whole = first == last && skip % tensor->per_chunk == 0 &&
                     key.element_begin + key.elements ==
                         std::min(tensor->owned.end, key.element_begin + tensor->per_chunk);
  // A chunk off the grid has a CRC of its own bytes, as its cast would.
  const uint32_t crc = whole ? crcs_[first] : Crc32c(data_.get() + offset, bytes);
  return CastChunk{SliceOf(offset, bytes), crc};
}

uint8_t* CastCache::Layer::Claim(const ChunkKey& key) {
  const Tensor* tensor = TensorOf(key);
  if (tensor == nullptr) return nullptr;
  const uint64_t skip = key.element_begin - tensor->owned.begin;
  if (skip % tensor->per_chunk != 0 ||
      key.element_begin + key.elements !=
          std::min(tensor->owned.end, key.element_begin + tensor->per_chunk)) {
    return nullptr;
  }
  uint8_t expected = kEmpty;
  if (!cells_[tensor->first_cell + skip / tensor->per_chunk].compare_exchange_strong(
          expected, kFilling, std::memory_order_acquire)) {
    return nullptr;
  }
  return data_.get() + tensor->offset + skip * DTypeSize(tensor->dtype);
}

CastChunk CastCache::Layer::Fill(const ChunkKey& key, uint32_t crc32c) {
  const Tensor& tensor = *TensorOf(key);
  const uint64_t skip = key.element_begin - tensor.owned.begin;
  const uint64_t cell = tensor.first_cell + skip / tensor.per_chunk;
  crcs_[cell] = crc32c;
  // Release: a Find that sees the chunk filled sees its bytes and CRC.
  cells_[cell].store(kFilled, std::memory_order_release);
  const size_t size = DTypeSize(tensor.dtype);
  return CastChunk{SliceOf(tensor.offset + skip * size, key.elements * size), crc32c};
}

void CastCache::Layer::Abandon(const ChunkKey& key) {
  const Tensor& tensor = *TensorOf(key);
  const uint64_t skip = key.element_begin - tensor.owned.begin;
  cells_[tensor.first_cell + skip / tensor.per_chunk].store(kEmpty, std::memory_order_release);
}

}  // namespace layercast::server
