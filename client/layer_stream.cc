#include "client/layer_stream.h"

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/byte_size.h"
#include "core/status_macros.h"

namespace layercast::client {

std::vector<uint32_t> ForwardOrder(uint32_t num_layers) {
  std::vector<uint32_t> order;
  for (uint32_t l = 0; l < num_layers; ++l) order.push_back(l);
  return order;
}

std::vector<uint32_t> BackwardOrder(uint32_t num_layers) {
  std::vector<uint32_t> order = ForwardOrder(num_layers);
  return {order.rbegin(), order.rend()};
}

std::vector<uint32_t> ForwardBackwardOrder(uint32_t num_layers) {
  std::vector<uint32_t> order = ForwardOrder(num_layers);
  std::vector<uint32_t> backward = BackwardOrder(num_layers);
  order.insert(order.end(), backward.begin(), backward.end());
  return order;
}

struct LayerStream::State : std::enable_shared_from_this<LayerStream::State> {
  State(const LayerSource& set, LayerStreamOptions options)
      : set(set), options(std::move(options)), pool(1) {}

  // Bytes of step `step`'s layer.
  uint64_t Bytes(size_t step) const {
    return set.view().layouts[options.order[step]].total_bytes();
  }

  // Starts the next gather if the order, the look-ahead and the budget allow.
  void MaybeFetchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (fetching || cancelled || next_to_fetch == options.order.size()) return;
    const uint64_t allowed_ahead =
        static_cast<uint64_t>(options.max_lookahead) + (caller_waiting ? 1 : 0);
    if (next_to_fetch >= next_to_return + allowed_ahead) return;
    const uint64_t bytes = Bytes(next_to_fetch);
    // in_use never exceeds the budget; written so that no sum can wrap.
    if (bytes > options.budget_bytes - in_use) return;
    in_use += bytes;
    peak = std::max(peak, in_use);
    fetching = true;
    const size_t step = next_to_fetch++;
    boost::asio::post(pool, [self = shared_from_this(), step, bytes] { self->Fetch(step, bytes); });
  }

  void Fetch(size_t step, uint64_t bytes) {
    const uint32_t layer = options.order[step];
    absl::StatusOr<LayerBuffer> buffer =
        LayerBuffer::Allocate(bytes, [weak = weak_from_this(), bytes] {
          if (auto self = weak.lock()) self->Release(bytes);
        });
    absl::StatusOr<Layer> result = [&]() -> absl::StatusOr<Layer> {
      if (!buffer.ok()) return buffer.status();
      GatherOptions gather = options.gather;
      gather.cancellation = &cancellation;
      ASSIGN_OR_RETURN(
          uint64_t version,
          set.GatherInto(layer, gather, std::span<uint8_t>(buffer->data(), buffer->size())));
      return set.MakeLayer(layer, version, *std::move(buffer));
    }();
    // A failed gather's buffer is freed here, returning its bytes.
    absl::MutexLock lock(&mu);
    if (!buffer.ok()) in_use -= bytes;  // no buffer, so no release hook to return them
    ready.emplace(step, std::move(result));
    fetching = false;
    MaybeFetchLocked();
  }

  void Release(uint64_t bytes) {
    absl::MutexLock lock(&mu);
    in_use -= bytes;
    MaybeFetchLocked();
  }

  const LayerSource& set;
  const LayerStreamOptions options;
  Cancellation cancellation;

  mutable absl::Mutex mu;
  size_t next_to_fetch ABSL_GUARDED_BY(mu) = 0;
  size_t next_to_return ABSL_GUARDED_BY(mu) = 0;
  std::map<size_t, absl::StatusOr<Layer>> ready ABSL_GUARDED_BY(mu);
  bool fetching ABSL_GUARDED_BY(mu) = false;
  bool caller_waiting ABSL_GUARDED_BY(mu) = false;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  uint64_t in_use ABSL_GUARDED_BY(mu) = 0;
  uint64_t peak ABSL_GUARDED_BY(mu) = 0;
  LayerStreamStats stats ABSL_GUARDED_BY(mu);

  // Last member: destroyed (joined) first, while the rest is still valid.
  boost::asio::thread_pool pool;
};

absl::StatusOr<std::unique_ptr<LayerStream>> LayerStream::Create(const LayerSource& set,
                                                                 LayerStreamOptions options) {
  const auto& layouts = set.view().layouts;
  for (uint32_t layer : options.order) {
    if (layer >= layouts.size()) {
      return absl::NotFoundError(absl::StrCat("the order names layer ", layer,
                                              ", but the model has ", layouts.size(), " layers (0-",
                                              layouts.size() - 1, ")"));
    }
    if (layouts[layer].total_bytes() > options.budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "layer ", layer, " (", set.view().model.layers[layer].name, ") assembles to ",
          FormatBytes(layouts[layer].total_bytes()), ", more than the stream's budget of ",
          FormatBytes(options.budget_bytes), ": raise the budget or fetch it in byte ranges"));
    }
  }
  auto state = std::make_shared<State>(set, std::move(options));
  {
    absl::MutexLock lock(&state->mu);
    state->stats.budget_bytes = state->options.budget_bytes;
    state->MaybeFetchLocked();
  }
  return std::unique_ptr<LayerStream>(new LayerStream(std::move(state)));
}

LayerStream::LayerStream(std::shared_ptr<State> state) : state_(std::move(state)) {}

LayerStream::~LayerStream() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->cancelled = true;
  }
  state_->cancellation.Cancel();
  state_->pool.join();
  // Layers fetched ahead and never handed out are freed here, outside the
  // lock: freeing one returns its bytes, which takes the lock.
  std::map<size_t, absl::StatusOr<Layer>> unclaimed;
  {
    absl::MutexLock lock(&state_->mu);
    unclaimed.swap(state_->ready);
  }
}

absl::StatusOr<Layer> LayerStream::Next() {
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
    // Nothing in flight and no room for it: only the caller can free bytes.
    return !s.fetching && s.next_to_fetch == step &&
           s.Bytes(step) > s.options.budget_bytes - s.in_use;
  };
  s.mu.Await(absl::Condition(&arrived_or_stuck));
  s.caller_waiting = false;
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.stats.wait_seconds += waited;
  (hit ? s.stats.hits : s.stats.misses)++;
  if (ClientMetrics* metrics = s.set.metrics()) metrics->RecordNext(hit, waited);
  auto it = s.ready.find(step);
  if (it == s.ready.end()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "layer ", s.options.order[step], " needs ", FormatBytes(s.Bytes(step)), " but the caller ",
        "holds ", FormatBytes(s.in_use), " of the stream's ", FormatBytes(s.options.budget_bytes),
        " budget in layers it has not dropped: drop a layer before asking for the next"));
  }
  absl::StatusOr<Layer> layer = std::move(it->second);
  s.ready.erase(it);
  ++s.next_to_return;
  ++s.stats.layers;
  s.MaybeFetchLocked();
  return layer;
}

LayerStreamStats LayerStream::stats() const {
  absl::MutexLock lock(&state_->mu);
  LayerStreamStats stats = state_->stats;
  stats.peak_bytes = state_->peak;
  return stats;
}

}  // namespace layercast::client
