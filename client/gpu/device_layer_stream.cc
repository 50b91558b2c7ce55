#include "client/gpu/device_layer_stream.h"

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <chrono>
#include <deque>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/gpu/cuda_status.h"
#include "core/byte_size.h"
#include "core/status_macros.h"

namespace layercast::gpu {

struct DeviceLayerStream::State : std::enable_shared_from_this<DeviceLayerStream::State> {
  State(DeviceLander& lander, DeviceLayerStreamOptions options,
        std::unique_ptr<DeviceMemoryPool> memory)
      : lander(lander), options(std::move(options)), memory(std::move(memory)), pool(1) {}

  uint64_t Bytes(size_t step) const { return lander.DeviceBytes(options.order[step]); }

  // Returns the bytes of frees that have completed on the device.
  void ReapCompletedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!pending_frees.empty() &&
           cudaEventQuery(pending_frees.front().freed.get()) != cudaErrorNotReady) {
      in_use -= pending_frees.front().bytes;
      pending_frees.pop_front();
    }
  }

  // Starts the next landing if the order, the look-ahead and the budget
  // allow; if only frees still running on the device stand in the way, waits
  // for the oldest of them in the background.
  void MaybeFetchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (fetching || cancelled || next_to_fetch == options.order.size()) return;
    const uint64_t allowed_ahead =
        static_cast<uint64_t>(options.max_lookahead) + (caller_waiting ? 1 : 0);
    if (next_to_fetch >= next_to_return + allowed_ahead) return;
    const uint64_t bytes = Bytes(next_to_fetch);
    ReapCompletedLocked();
    if (in_use + bytes > options.budget_bytes) {
      if (!reaping && !pending_frees.empty()) {
        reaping = true;
        PendingFree oldest = std::move(pending_frees.front());
        pending_frees.pop_front();
        boost::asio::post(pool, [self = shared_from_this(), oldest = std::move(oldest)]() mutable {
          self->Reap(std::move(oldest));
        });
      }
      return;
    }
    in_use += bytes;
    peak = std::max(peak, in_use);
    fetching = true;
    const size_t step = next_to_fetch++;
    boost::asio::post(pool, [self = shared_from_this(), step, bytes] { self->Fetch(step, bytes); });
  }

  struct PendingFree {
    CudaEvent freed;  // completes when the memory is free on the device
    uint64_t bytes;
  };

  void Reap(PendingFree free) {
    // A host wait, on the stream's own thread, for device work (the compute
    // that last read the layer, then the free): the only way bytes come back.
    cudaEventSynchronize(free.freed.get());
    cudaGetLastError();
    absl::MutexLock lock(&mu);
    in_use -= free.bytes;
    reaping = false;
    MaybeFetchLocked();
  }

  void Released(uint64_t bytes, CudaEvent freed) {
    absl::MutexLock lock(&mu);
    if (freed) {
      pending_frees.push_back(PendingFree{std::move(freed), bytes});
    } else {
      in_use -= bytes;
    }
    MaybeFetchLocked();
  }

  absl::StatusOr<DeviceLayer> Land(uint32_t layer, uint64_t bytes) {
    DeviceGuard guard(lander.device());
    if (!guard.status().ok()) {
      Released(bytes, CudaEvent());
      return guard.status();
    }
    absl::StatusOr<DeviceBuffer> allocated =
        memory->Allocate(bytes, lander.stream(), [weak = weak_from_this(), bytes](CudaEvent freed) {
          if (auto self = weak.lock()) self->Released(bytes, std::move(freed));
        });
    if (!allocated.ok()) {
      Released(bytes, CudaEvent());  // nothing was allocated: the bytes come back now
      return allocated.status();
    }
    DeviceBuffer buffer = *std::move(allocated);
    client::GatherOptions gather = options.gather;
    gather.cancellation = &cancellation;
    absl::StatusOr<uint64_t> version = lander.Land(layer, gather, buffer.data());
    // Even after a failure copies may be in flight into the buffer: its free
    // must wait for them.
    RETURN_IF_ERROR(buffer.RecordUse(lander.stream()));
    RETURN_IF_ERROR(version.status());
    ASSIGN_OR_RETURN(CudaEvent ready, CudaEvent::Create());
    CUDA_RETURN_IF_ERROR(cudaEventRecord(ready.get(), lander.stream()),
                         "cudaEventRecord (layer ready)");
    const client::ShardSetView& view = lander.source().view();
    return DeviceLayer(layer, &view.model.layers[layer], &view.layouts[layer], *version,
                       std::move(buffer), std::move(ready));
  }

  void Fetch(size_t step, uint64_t bytes) {
    // A failed landing's buffer is freed inside Land, before the lock.
    absl::StatusOr<DeviceLayer> result = Land(options.order[step], bytes);
    absl::MutexLock lock(&mu);
    ready.emplace(step, std::move(result));
    fetching = false;
    MaybeFetchLocked();
  }

  DeviceLander& lander;
  const DeviceLayerStreamOptions options;
  const std::unique_ptr<DeviceMemoryPool> memory;
  client::Cancellation cancellation;

  mutable absl::Mutex mu;
  size_t next_to_fetch ABSL_GUARDED_BY(mu) = 0;
  size_t next_to_return ABSL_GUARDED_BY(mu) = 0;
  std::map<size_t, absl::StatusOr<DeviceLayer>> ready ABSL_GUARDED_BY(mu);
  std::deque<PendingFree> pending_frees ABSL_GUARDED_BY(mu);
  bool fetching ABSL_GUARDED_BY(mu) = false;
  bool reaping ABSL_GUARDED_BY(mu) = false;
  bool caller_waiting ABSL_GUARDED_BY(mu) = false;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  uint64_t in_use ABSL_GUARDED_BY(mu) = 0;
  uint64_t peak ABSL_GUARDED_BY(mu) = 0;
  DeviceLayerStreamStats stats ABSL_GUARDED_BY(mu);

  // Last member: destroyed (joined) first, while the rest is still valid.
  boost::asio::thread_pool pool;
};

absl::StatusOr<std::unique_ptr<DeviceLayerStream>> DeviceLayerStream::Create(
    DeviceLander& lander, DeviceLayerStreamOptions options) {
  const client::ShardSetView& view = lander.source().view();
  for (uint32_t layer : options.order) {
    if (layer >= view.layouts.size()) {
      return absl::NotFoundError(absl::StrCat("the order names layer ", layer,
                                              ", but the model has ", view.layouts.size(),
                                              " layers (0-", view.layouts.size() - 1, ")"));
    }
    if (lander.DeviceBytes(layer) > options.budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "layer ", layer, " (", view.model.layers[layer].name, ") needs ",
          FormatBytes(lander.DeviceBytes(layer)), " of device memory, more than the stream's ",
          "budget of ", FormatBytes(options.budget_bytes), ": raise the budget"));
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceMemoryPool> memory,
                   DeviceMemoryPool::Create(lander.device(), options.budget_bytes));
  auto state = std::make_shared<State>(lander, std::move(options), std::move(memory));
  {
    absl::MutexLock lock(&state->mu);
    state->stats.budget_bytes = state->options.budget_bytes;
    state->MaybeFetchLocked();
  }
  return std::unique_ptr<DeviceLayerStream>(new DeviceLayerStream(std::move(state)));
}

DeviceLayerStream::DeviceLayerStream(std::shared_ptr<State> state) : state_(std::move(state)) {}

DeviceLayerStream::~DeviceLayerStream() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->cancelled = true;
  }
  state_->cancellation.Cancel();
  state_->pool.join();
  // Layers landed ahead and never handed out are freed outside the lock:
  // freeing one returns its bytes, which takes the lock.
  std::map<size_t, absl::StatusOr<DeviceLayer>> unclaimed;
  {
    absl::MutexLock lock(&state_->mu);
    unclaimed.swap(state_->ready);
  }
}

absl::StatusOr<DeviceLayer> DeviceLayerStream::Next() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  if (s.next_to_return == s.options.order.size()) {
    return absl::OutOfRangeError(absl::StrCat("the stream has handed out all ",
                                              s.options.order.size(), " layers of its order"));
  }
  const size_t step = s.next_to_return;
  const bool hit = s.ready.count(step) > 0;
  const auto start = std::chrono::steady_clock::now();
  s.caller_waiting = true;
  s.MaybeFetchLocked();
  const auto arrived_or_stuck = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    if (s.ready.count(step) > 0) return true;
    // Nothing in flight, no free to wait for, and no room: only the caller
    // can free bytes.
    return !s.fetching && !s.reaping && s.pending_frees.empty() && s.next_to_fetch == step &&
           s.in_use + s.Bytes(step) > s.options.budget_bytes;
  };
  s.mu.Await(absl::Condition(&arrived_or_stuck));
  s.caller_waiting = false;
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.stats.wait_seconds += waited;
  (hit ? s.stats.hits : s.stats.misses)++;
  if (client::ClientMetrics* metrics = s.lander.source().metrics()) {
    metrics->RecordNext(hit, waited);
  }
  auto it = s.ready.find(step);
  if (it == s.ready.end()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "layer ", s.options.order[step], " needs ", FormatBytes(s.Bytes(step)),
        " of device memory but the caller holds ", FormatBytes(s.in_use), " of the stream's ",
        FormatBytes(s.options.budget_bytes),
        " budget in layers it has not dropped: drop a layer before asking for the next"));
  }
  absl::StatusOr<DeviceLayer> layer = std::move(it->second);
  s.ready.erase(it);
  ++s.next_to_return;
  ++s.stats.layers;
  s.MaybeFetchLocked();
  return layer;
}

DeviceLayerStreamStats DeviceLayerStream::stats() const {
  absl::MutexLock lock(&state_->mu);
  DeviceLayerStreamStats stats = state_->stats;
  stats.peak_bytes = state_->peak;
  stats.pool_reserved_high_bytes = state_->memory->reserved_high_bytes();
  return stats;
}

}  // namespace layercast::gpu
