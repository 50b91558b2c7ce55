#include "server/training/staging_pool.h"

#include <utility>

namespace layercast::server {
namespace {

uint64_t BytesOf(const std::vector<float>& buffer) { return buffer.size() * sizeof(float); }

}  // namespace

std::vector<std::vector<float>> StagingPool::Claim(uint64_t elements, uint32_t count) {
  std::vector<std::vector<float>> claimed;
  absl::MutexLock lock(&mu_);
  for (auto it = buffers_.begin(); it != buffers_.end() && claimed.size() < count;) {
    if (it->size() != elements) {
      ++it;
      continue;
    }
    bytes_ -= BytesOf(*it);
    claimed.push_back(std::move(*it));
    it = buffers_.erase(it);
  }
  return claimed;
}

void StagingPool::Give(std::vector<float> buffer) {
  std::vector<std::vector<float>> evicted;
  {
    absl::MutexLock lock(&mu_);
    // A request waiting for budget gets the bytes instead: it asked the
    // reclaimer once, when it began to wait, before this buffer was here.
    if (BytesOf(buffer) > max_bytes_ || (budget_ != nullptr && budget_->waiting() > 0)) {
      evicted.push_back(std::move(buffer));
    } else {
      bytes_ += BytesOf(buffer);
      buffers_.push_back(std::move(buffer));
      while (bytes_ > max_bytes_) {
        bytes_ -= BytesOf(buffers_.front());
        evicted.push_back(std::move(buffers_.front()));
        buffers_.pop_front();
      }
    }
  }
  Free(std::move(evicted));
}

void StagingPool::Drain() {
  std::vector<std::vector<float>> all;
  {
    absl::MutexLock lock(&mu_);
    for (std::vector<float>& buffer : buffers_) all.push_back(std::move(buffer));
    buffers_.clear();
    bytes_ = 0;
  }
  Free(std::move(all));
}

uint64_t StagingPool::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

void StagingPool::Free(std::vector<std::vector<float>> buffers) {
  uint64_t bytes = 0;
  for (const std::vector<float>& buffer : buffers) bytes += BytesOf(buffer);
  buffers.clear();  // the memory goes before the budget hands its charge on
  if (budget_ != nullptr && bytes > 0) budget_->Release(bytes);
}

}  // namespace layercast::server
