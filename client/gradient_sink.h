#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/client_defaults.h"
#include "client/layer.h"
#include "client/shard_set.h"
#include "wire/gradient_chunks.h"

namespace layercast::client {

struct GradientSinkOptions {
  // This worker's index among the shard set's --data-parallel-workers.
  uint32_t worker = 0;
  // Gradient data per GradientChunk.
  uint64_t chunk_bytes = wire::kWriteChunkBytes;
  // Gradient bytes handed over and not yet pushed to every shard; Push
  // blocks while one more layer would exceed it (a layer larger than the
  // whole budget is taken when nothing else is queued).
  uint64_t max_bytes_in_flight = 512ull << 20;
  // A layer's push to one shard, retries included, ends by then.
  std::chrono::milliseconds timeout = kPushTimeout;
  // Pushes of different layers in flight to one shard at once: with two,
  // the next layer's gradient streams while the shard runs the optimizer on
  // the one before (a push's answer waits for its step when it is the last
  // worker's).
  uint32_t streams_per_shard = 2;
  // This worker's token, when the shards were started with
  // --worker-token-dir (their worker-<worker> file): sent with every push
  // and clip scale. Surrounding whitespace is trimmed.
  std::string worker_token = {};
  // Send worker_token even though the shard set is connected without TLS
  // (loopback testing only); otherwise Create refuses.
  bool insecure = false;
};

// What a shard set said to one layer's push.
struct PushResult {
  uint32_t layer = 0;
  uint64_t step = 0;
  // The layer's version after the push, the lowest any shard reported:
  // step + 1 once every shard has applied the step.
  uint64_t layer_version = 0;
  // This push completed the step on every shard (the last worker's push).
  bool applied = false;
  // The shards on which this push completed the step: workers' pushes race,
  // so the last to arrive may be another worker's on each shard.
  uint32_t shards_applied = 0;
};

// Sends a worker's gradients to the shards, layer by layer, beside the
// LayerStream that gathers the weights: hand it each layer's gradient as
// soon as its backward pass is done, in the layer's gradient layout
// (ShardSetView::gradient_layouts: each tensor in its compute dtype, but
// 8-bit float tensors in float32), and go on with the next layer. In the background it cuts the
// buffer by ownership (wire::GradientChunker) and streams every shard its part, layers taken in the
// order given, `streams_per_shard` threads per shard.
//
// Retries: a stream that fails UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED,
// CANCELLED or DEADLINE_EXCEEDED is pushed again whole after a backoff,
// until `timeout` (platform::kGradientPush). A shard stages a push only when its stream completes,
// so a retry never counts twice; when a retry is told ALREADY_EXISTS the first attempt did arrive,
// and the push succeeded. So does a first attempt told ALREADY_EXISTS: a worker restarted with its
// index pushes the step it died in again, the layers it pushed before count once, and the rest
// complete the step (a second process with the same index would go unnoticed but for the log line;
// --worker-token-dir keeps other peers out).
//
// Thread-safe.
class GradientSink {
 public:
  // `shards` must outlive the sink. FAILED_PRECONDITION for read-only
  // shards (their manifest names no workers); INVALID_ARGUMENT for a worker
  // outside the set the manifest names, or chunk_bytes < 4.
  static absl::StatusOr<std::unique_ptr<GradientSink>> Create(const ShardSet& shards,
                                                              GradientSinkOptions options);
  // Finishes every push handed over, then stops.
  ~GradientSink();

  // Hands over `gradient` of `layer`, computed at version `step` of it; the
  // future is ready when every shard has taken it (or one failed). Blocks
  // while max_bytes_in_flight is in use. INVALID_ARGUMENT at once for a
  // layer out of range or a buffer of the wrong size.
  absl::StatusOr<std::shared_future<absl::StatusOr<PushResult>>> Push(uint32_t layer, uint64_t step,
                                                                      LayerBuffer gradient);

  // Waits for every push handed over so far; the first error, if any.
  absl::Status Flush();

  struct StepEnd {
    bool clipped = false;   // the shards clip, and this worker sent the scale
    double total_norm = 0;  // the model's mean-gradient norm, when clipped
    float scale = 1;        // what every mean gradient was multiplied by
  };
  // Ends this worker's part of step `step`: Flush(). On worker 0, when the
  // shards clip gradients (clip= in their --optimizer), it then completes
  // the step for every worker, the step barrier clipping needs: it asks
  // every shard, until all workers' pushes are in, for its partial sum of
  // squares of the mean gradient (fp64), adds them in shard order, takes
  // the square root and ClipScale of it, and sends that scale to every
  // shard, which then steps every layer. Retries as pushes do, until
  // `timeout`; a scale some shard applied already is reused, so a worker 0
  // restarted mid-step finishes it consistently.
  absl::StatusOr<StepEnd> FinishStep(uint64_t step);

  uint64_t bytes_pushed() const;  // gradient data sent, retries included

 private:
  struct Task;
  GradientSink(const ShardSet& shards, GradientSinkOptions options);
  // Sends this worker's token with the call, when it has one.
  void AddWorkerToken(grpc::ClientContext& context) const;
  void RunShard(uint32_t shard);
  // One layer to one shard, retries included.
  absl::StatusOr<layercast::v1::PushGradientsResponse> PushToShard(uint32_t shard,
                                                                   const Task& task);
  void Settle(Task& task, uint32_t shard,
              absl::StatusOr<layercast::v1::PushGradientsResponse> result);

  const ShardSet& shards_;
  const GradientSinkOptions options_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t bytes_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_pushed_ ABSL_GUARDED_BY(mu_) = 0;
  // Per shard, the layers it still has to push, in order.
  std::vector<std::deque<std::shared_ptr<Task>>> queues_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_future<absl::StatusOr<PushResult>>> unflushed_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;  // last: started once the rest is set
};

}  // namespace layercast::client
