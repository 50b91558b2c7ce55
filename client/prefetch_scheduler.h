#pragma once

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/pinned_identity.h"
#include "client/prefetch_options.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::client {

// Memory a landed layer has given up but that is not free yet: a GPU's
// stream-ordered free that the device has not reached. The scheduler counts
// its bytes as held until Done(), and when only such frees stand in the way
// of the next landing, waits for the oldest with Wait() on its own thread.
class PendingRelease {
 public:
  virtual ~PendingRelease() = default;
  // Whether the memory is free now; never blocks.
  virtual bool Done() = 0;
  // Blocks until the memory is free.
  virtual void Wait() = 0;
};

// Hands out the layers of a declared order one by one, landing them ahead on
// a background thread (a Boost.Asio thread) as far as the byte budget and
// the look-ahead allow, never beyond, strictly in order. What a landing is
// (a host buffer; device memory with a deferred, event-guarded free) is the
// Landing's business; the order, the look-ahead, the budget, stuck
// detection, statistics and shutdown are this class's, once for both.
//
// `LayerT` is what Next() hands out (client::Layer, gpu::DeviceLayer): an
// RAII handle whose destruction gives its memory back through the Released
// callback the landing was given.
//
// Next() is for one caller thread; stats() may be called from any thread.
template <typename LayerT>
class PrefetchScheduler : public std::enable_shared_from_this<PrefetchScheduler<LayerT>> {
 public:
  // Called exactly once per landing, when its memory comes back: with
  // nullptr if it is free at once, or with what to wait for.
  using Released = std::function<void(std::unique_ptr<PendingRelease>)>;

  // Where and how layers land. Land runs on the scheduler's thread, one at a
  // time; the rest may be called from any thread.
  class Landing {
   public:
    virtual ~Landing() = default;
    virtual const wire::ShardSetView& view() const = 0;
    virtual ClientMetrics* metrics() const = 0;
    // Bytes a landing of `layer` charges the budget. REQUIRES: layer exists.
    virtual uint64_t Bytes(uint32_t layer) const = 0;
    // How a layer's size reads in messages: "assembles to 1.00 GiB",
    // "needs 1.00 GiB of device memory".
    virtual std::string Needs(uint32_t layer) const = 0;
    // Lands `layer` in `bytes` of memory of its own. Calls `released` exactly
    // once: when the layer's memory comes back, or before returning when it
    // fails having kept none.
    virtual absl::StatusOr<LayerT> Land(uint32_t layer, uint64_t bytes, const GatherOptions& gather,
                                        Released released) = 0;
  };

  // Refuses an order naming a layer that does not exist (NOT_FOUND), or one
  // that needs more than the budget (RESOURCE_EXHAUSTED naming the sizes).
  static absl::Status CheckOrder(const Landing& landing, const PrefetchOptions& options) {
    const wire::ShardSetView& view = landing.view();
    for (uint32_t layer : options.order) {
      if (layer >= view.layouts.size()) {
        return absl::NotFoundError(absl::StrCat("the order names layer ", layer,
                                                ", but the model has ", view.layouts.size(),
                                                " layers (0-", view.layouts.size() - 1, ")"));
      }
      if (landing.Bytes(layer) > options.budget_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "layer ", layer, " (", view.model.layers[layer].name, ") ", landing.Needs(layer),
            ", more than the stream's budget of ", FormatBytes(options.budget_bytes),
            ": raise the budget or fetch it in byte ranges"));
      }
    }
    return absl::OkStatus();
  }

  // Checks the order (CheckOrder), then starts landing ahead.
  static absl::StatusOr<std::shared_ptr<PrefetchScheduler>> Create(std::unique_ptr<Landing> landing,
                                                                   PrefetchOptions options) {
    RETURN_IF_ERROR(CheckOrder(*landing, options));
    auto scheduler = std::shared_ptr<PrefetchScheduler>(
        new PrefetchScheduler(std::move(landing), std::move(options)));
    absl::MutexLock lock(&scheduler->mu_);
    scheduler->stats_.budget_bytes = scheduler->options_.budget_bytes;
    scheduler->MaybeLandLocked();
    return scheduler;
  }

  // Cancels the landing in flight and waits for it; layers landed ahead and
  // never handed out are freed. Layers handed out stay valid. Call once,
  // before the last reference goes (the owning stream's destructor does).
  void Shutdown() {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    cancellation_.Cancel();
    pool_.join();
    // Freed outside the lock: freeing one returns its bytes, which takes it.
    std::map<size_t, absl::StatusOr<LayerT>> unclaimed;
    absl::MutexLock lock(&mu_);
    unclaimed.swap(ready_);
  }

  // The next layer of the order, waiting for it if needed. OUT_OF_RANGE after
  // the last; the landing's error if it failed; RESOURCE_EXHAUSTED if the
  // next layer can never fit because the caller holds too many layers.
  absl::StatusOr<LayerT> Next() {
    absl::MutexLock lock(&mu_);
    if (next_to_return_ == options_.order.size()) {
      return absl::OutOfRangeError(absl::StrCat("the stream has handed out all ",
                                                options_.order.size(), " layers of its order"));
    }
    const size_t step = next_to_return_;
    const bool hit = ready_.count(step) > 0;
    const auto start = std::chrono::steady_clock::now();
    caller_waiting_ = true;
    MaybeLandLocked();
    const auto arrived_or_stuck = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (ready_.count(step) > 0) return true;
      // Nothing in flight, no free to wait for, and no room: only the
      // caller can give bytes back.
      return !landing_in_flight_ && !reaping_ && pending_.empty() && next_to_land_ == step &&
             Bytes(step) > options_.budget_bytes - in_use_;
    };
    mu_.Await(absl::Condition(&arrived_or_stuck));
    caller_waiting_ = false;
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stats_.wait_seconds += waited;
    (hit ? stats_.hits : stats_.misses)++;
    if (ClientMetrics* metrics = landing_->metrics()) metrics->RecordNext(hit, waited);
    auto it = ready_.find(step);
    if (it == ready_.end()) {
      const uint32_t layer = options_.order[step];
      return absl::ResourceExhaustedError(absl::StrCat(
          "layer ", layer, " ", landing_->Needs(layer), " but the caller holds ",
          FormatBytes(in_use_), " of the stream's ", FormatBytes(options_.budget_bytes),
          " budget in layers it has not dropped: drop a layer before asking for the next"));
    }
    absl::StatusOr<LayerT> layer = std::move(it->second);
    ready_.erase(it);
    ++next_to_return_;
    ++stats_.layers;
    MaybeLandLocked();
    return layer;
  }

  PrefetchStats stats() const {
    absl::MutexLock lock(&mu_);
    PrefetchStats stats = stats_;
    stats.peak_bytes = peak_;
    return stats;
  }

 private:
  PrefetchScheduler(std::unique_ptr<Landing> landing, PrefetchOptions options)
      : landing_(std::move(landing)), options_(std::move(options)), pool_(1) {}

  uint64_t Bytes(size_t step) const { return landing_->Bytes(options_.order[step]); }

  // Takes back the bytes of pending releases that have completed.
  void ReapCompletedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!pending_.empty() && pending_.front().release->Done()) {
      in_use_ -= pending_.front().bytes;
      pending_.pop_front();
    }
  }

  // Starts the next landing if the order, the look-ahead and the budget
  // allow; if only pending releases stand in the way, waits for the oldest
  // of them in the background.
  void MaybeLandLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (landing_in_flight_ || cancelled_ || next_to_land_ == options_.order.size()) return;
    const uint64_t allowed_ahead =
        static_cast<uint64_t>(options_.max_lookahead) + (caller_waiting_ ? 1 : 0);
    if (next_to_land_ >= next_to_return_ + allowed_ahead) return;
    const uint64_t bytes = Bytes(next_to_land_);
    ReapCompletedLocked();
    // in_use_ never exceeds the budget; written so that no sum can wrap.
    if (bytes > options_.budget_bytes - in_use_) {
      if (!reaping_ && !pending_.empty()) {
        reaping_ = true;
        std::shared_ptr<Pending> oldest = std::make_shared<Pending>(std::move(pending_.front()));
        pending_.pop_front();
        boost::asio::post(
            pool_, [self = this->shared_from_this(), oldest] { self->Reap(std::move(*oldest)); });
      }
      return;
    }
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    landing_in_flight_ = true;
    const size_t step = next_to_land_++;
    boost::asio::post(pool_,
                      [self = this->shared_from_this(), step, bytes] { self->Land(step, bytes); });
  }

  struct Pending {
    std::unique_ptr<PendingRelease> release;
    uint64_t bytes;
  };

  void Reap(Pending pending) {
    // A host wait, on the scheduler's own thread, for the device: the only
    // way those bytes come back.
    pending.release->Wait();
    absl::MutexLock lock(&mu_);
    in_use_ -= pending.bytes;
    reaping_ = false;
    MaybeLandLocked();
  }

  void GiveBack(uint64_t bytes, std::unique_ptr<PendingRelease> release) {
    absl::MutexLock lock(&mu_);
    if (release != nullptr && !release->Done()) {
      pending_.push_back(Pending{std::move(release), bytes});
    } else {
      in_use_ -= bytes;
    }
    MaybeLandLocked();
  }

  void Land(size_t step, uint64_t bytes) {
    GatherOptions gather = options_.gather;
    gather.cancellation = &cancellation_;
    // A pinned walk reads one identity, not just one number, throughout.
    if (gather.exact_version && gather.pinned_identity == nullptr)
      gather.pinned_identity = &pinned_;
    // The callback may outlive the scheduler (a layer kept after the stream
    // is gone): it then has no budget to return to.
    std::weak_ptr<PrefetchScheduler> weak = this->weak_from_this();
    absl::StatusOr<LayerT> layer =
        landing_->Land(options_.order[step], bytes, gather,
                       [weak, bytes](std::unique_ptr<PendingRelease> release) {
                         if (auto self = weak.lock()) self->GiveBack(bytes, std::move(release));
                       });
    absl::MutexLock lock(&mu_);
    ready_.emplace(step, std::move(layer));
    ++stats_.landed;
    landing_in_flight_ = false;
    MaybeLandLocked();
  }

  const std::unique_ptr<Landing> landing_;
  const PrefetchOptions options_;
  Cancellation cancellation_;
  PinnedIdentity pinned_;  // what a walk with gather.exact_version read

  mutable absl::Mutex mu_;
  size_t next_to_land_ ABSL_GUARDED_BY(mu_) = 0;
  size_t next_to_return_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<size_t, absl::StatusOr<LayerT>> ready_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);  // releases the device has not reached
  bool landing_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool reaping_ ABSL_GUARDED_BY(mu_) = false;
  bool caller_waiting_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  PrefetchStats stats_ ABSL_GUARDED_BY(mu_);

  // Last member: destroyed (joined) first, while the rest is still valid.
  boost::asio::thread_pool pool_;
};

}  // namespace layercast::client
