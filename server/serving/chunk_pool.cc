#include "server/serving/chunk_pool.h"

#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "platform/byte_size.h"

namespace layercast::server {

namespace {

// Cache-line aligned: the kernels' stores do not straddle lines, and a
// size that is a multiple of the alignment, as std::aligned_alloc wants.
constexpr size_t kAlign = 64;

size_t Rounded(uint64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

struct ChunkPool::Buffer {
  uint8_t* data = nullptr;
  bool charged = false;               // in the pool's charge (kept)
  std::shared_ptr<State> owner = {};  // set while lent
};

struct ChunkPool::State {
  State(uint64_t bytes, size_t max, MemoryBudget* b)
      : buffer_bytes(bytes), max_buffers(max), budget(b) {}
  ~State() {
    for (Buffer* buffer : idle) {
      std::free(buffer->data);
      delete buffer;
    }
  }

  const uint64_t buffer_bytes;
  const size_t max_buffers;
  mutable absl::Mutex mu;
  // Null once the pool is gone: buffers coming back are freed.
  MemoryBudget* budget ABSL_GUARDED_BY(mu);
  std::vector<Buffer*> idle ABSL_GUARDED_BY(mu);  // warmest last
  size_t charged ABSL_GUARDED_BY(mu) = 0;         // buffers kept (idle or lent)
  size_t asking ABSL_GUARDED_BY(mu) = 0;          // places held while the budget is asked
  uint64_t made ABSL_GUARDED_BY(mu) = 0;
};

ChunkPool::ChunkPool(uint64_t buffer_bytes, size_t max_buffers, MemoryBudget& budget)
    : state_(std::make_shared<State>(Rounded(buffer_bytes), max_buffers, &budget)) {}

ChunkPool::~ChunkPool() {
  Drain();
  MemoryBudget* budget = nullptr;
  uint64_t lent_bytes = 0;
  {
    absl::MutexLock lock(&state_->mu);
    budget = std::exchange(state_->budget, nullptr);
    lent_bytes = state_->charged * state_->buffer_bytes;
    state_->charged = 0;
  }
  // Buffers still lent are freed when they come back, uncharged.
  if (lent_bytes > 0) budget->Release(lent_bytes);
}

absl::StatusOr<ChunkPool::Lent> ChunkPool::Take(uint64_t bytes) {
  if (bytes > state_->buffer_bytes) {
    auto* data = static_cast<uint8_t*>(std::malloc(bytes));
    if (data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of memory for a chunk of ", FormatBytes(bytes), "; retry later"));
    }
    return Lent{grpc::Slice(data, bytes, std::free), data};
  }
  Buffer* buffer = nullptr;
  {
    absl::MutexLock lock(&state_->mu);
    if (!state_->idle.empty()) {
      buffer = state_->idle.back();
      state_->idle.pop_back();
    } else {
      ++state_->made;
    }
  }
  if (buffer == nullptr) {
    auto* data = static_cast<uint8_t*>(std::aligned_alloc(kAlign, state_->buffer_bytes));
    if (data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("out of memory for a chunk buffer of ",
                                                       FormatBytes(state_->buffer_bytes),
                                                       "; retry later"));
    }
    // Faulted in here, once, rather than page by page under the cast.
    std::memset(data, 0, state_->buffer_bytes);
    buffer = new Buffer{.data = data};
  }
  buffer->owner = state_;
  return Lent{grpc::Slice(buffer->data, bytes, &ChunkPool::Return, buffer), buffer->data};
}

void ChunkPool::Return(void* lent) {
  auto* buffer = static_cast<Buffer*>(lent);
  std::shared_ptr<State> state = std::move(buffer->owner);
  MemoryBudget* charge_to = nullptr;
  {
    absl::MutexLock lock(&state->mu);
    if (state->budget != nullptr && buffer->charged) {
      state->idle.push_back(buffer);
      return;
    }
    if (state->budget != nullptr && state->charged + state->asking < state->max_buffers) {
      ++state->asking;
      charge_to = state->budget;
    }
  }
  // Outside the pool's lock: the budget's reclaimer drains the pool.
  if (charge_to != nullptr) {
    const bool granted = charge_to->TryAcquire(state->buffer_bytes);
    bool went = false;
    {
      absl::MutexLock lock(&state->mu);
      --state->asking;
      if (granted && state->budget != nullptr) {
        ++state->charged;
        buffer->charged = true;
        state->idle.push_back(buffer);
        return;
      }
      went = state->budget == nullptr;
    }
    // The pool went while the budget was asked: its end did not count this.
    if (granted && went) charge_to->Release(state->buffer_bytes);
  }
  std::free(buffer->data);
  delete buffer;
}

void ChunkPool::Drain() {
  std::vector<Buffer*> freed;
  MemoryBudget* budget = nullptr;
  {
    absl::MutexLock lock(&state_->mu);
    freed.swap(state_->idle);
    state_->charged -= freed.size();
    budget = state_->budget;
  }
  for (Buffer* buffer : freed) {
    std::free(buffer->data);
    delete buffer;
  }
  if (budget != nullptr && !freed.empty()) budget->Release(freed.size() * state_->buffer_bytes);
}

uint64_t ChunkPool::buffer_bytes() const { return state_->buffer_bytes; }

size_t ChunkPool::idle_buffers() const {
  absl::MutexLock lock(&state_->mu);
  return state_->idle.size();
}

uint64_t ChunkPool::buffers_made() const {
  absl::MutexLock lock(&state_->mu);
  return state_->made;
}

uint64_t ChunkPool::charged_bytes() const {
  absl::MutexLock lock(&state_->mu);
  return state_->charged * state_->buffer_bytes;
}

}  // namespace layercast::server
