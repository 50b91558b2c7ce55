#include "client/gradient_sink.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/bearer_token.h"
#include "core/optimizer.h"
#include "platform/log.h"
#include "platform/retry.h"
#include "platform/status_macros.h"
#include "wire/gradient_chunks.h"
#include "wire/grpc_status.h"

namespace layercast::client {
struct GradientSink::Task {
  uint32_t layer = 0;
  uint64_t step = 0;
  LayerBuffer gradient;
  std::chrono::steady_clock::time_point deadline;
  std::promise<absl::StatusOr<PushResult>> promise;
  // Under the sink's mutex: shards still pushing, and what they said.
  uint32_t remaining = 0;
  absl::Status failure;
  PushResult result;
};

absl::StatusOr<std::unique_ptr<GradientSink>> GradientSink::Create(const ShardSet& shards,
                                                                   GradientSinkOptions options) {
  if (options.streams_per_shard == 0 || options.streams_per_shard > 64) {
    return absl::InvalidArgumentError(absl::StrCat("streams_per_shard ", options.streams_per_shard,
                                                   " is out of range: use 1-64"));
  }
  if (options.chunk_bytes < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", options.chunk_bytes, " cannot hold one element: use >= 4"));
  }
  // The manifest names the set's workers: a sink that could only be
  // refused is refused here, before any layer is computed for it.
  const layercast::v1::Manifest& manifest = shards.manifests().front();
  if (manifest.data_parallel_workers() == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the shards serve ", manifest.model_id(),
        " read-only (no --optimizer): they take no gradients; start them with --optimizer SPEC "
        "and --data-parallel-workers W to train"));
  }
  if (options.worker >= manifest.data_parallel_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", options.worker, " is not in the shards' set of ",
                     manifest.data_parallel_workers(),
                     " data-parallel worker(s) (--data-parallel-workers): "
                     "use 0-",
                     manifest.data_parallel_workers() - 1));
  }
  if (!options.worker_token.empty()) {
    ASSIGN_OR_RETURN(options.worker_token,
                     CleanBearerToken(options.worker_token, "the worker token"));
    RETURN_IF_ERROR(CheckTokenTransport(shards.tls(), options.insecure, "insecure"));
  }
  return std::unique_ptr<GradientSink>(new GradientSink(shards, options));
}

GradientSink::GradientSink(const ShardSet& shards, GradientSinkOptions options)
    : shards_(shards), options_(options) {
  const auto num_shards = static_cast<uint32_t>(shards_.addresses().size());
  {
    absl::MutexLock lock(&mu_);
    queues_.resize(num_shards);
  }
  for (uint32_t s = 0; s < num_shards; ++s) {
    for (uint32_t k = 0; k < options_.streams_per_shard; ++k) {
      threads_.emplace_back([this, s] { RunShard(s); });
    }
  }
}

GradientSink::~GradientSink() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

uint64_t GradientSink::bytes_pushed() const {
  absl::MutexLock lock(&mu_);
  return bytes_pushed_;
}

absl::StatusOr<std::shared_future<absl::StatusOr<PushResult>>> GradientSink::Push(
    uint32_t layer, uint64_t step, LayerBuffer gradient) {
  const wire::ShardSetView& view = shards_.view();
  if (layer >= view.gradient_layouts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer,
                                                   " does not exist: this model has ",
                                                   view.gradient_layouts.size(), " layers"));
  }
  if (gradient.size() != view.gradient_layouts[layer].total_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the gradient of layer ", layer, " is ", gradient.size(),
                     " bytes; it must be the layer's gradient layout, ",
                     view.gradient_layouts[layer].total_bytes(),
                     " bytes (each tensor in its compute dtype, 8-bit float ones in float32)"));
  }
  auto task = std::make_shared<Task>();
  task->layer = layer;
  task->step = step;
  task->gradient = std::move(gradient);
  task->deadline = std::chrono::steady_clock::now() + options_.timeout;
  task->result = PushResult{layer, step, UINT64_MAX, true};
  std::shared_future<absl::StatusOr<PushResult>> done = task->promise.get_future().share();
  const uint64_t bytes = task->gradient.size();
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    return absl::FailedPreconditionError("the gradient sink is being destroyed: push before");
  }
  const auto room = [this, bytes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return bytes_in_flight_ == 0 || bytes_in_flight_ + bytes <= options_.max_bytes_in_flight;
  };
  mu_.Await(absl::Condition(&room));
  bytes_in_flight_ += bytes;
  task->remaining = static_cast<uint32_t>(queues_.size());
  for (auto& queue : queues_) queue.push_back(task);
  unflushed_.push_back(done);
  return done;
}

absl::Status GradientSink::Flush() {
  std::vector<std::shared_future<absl::StatusOr<PushResult>>> pending;
  {
    absl::MutexLock lock(&mu_);
    pending.swap(unflushed_);
  }
  absl::Status first;
  for (auto& done : pending) {
    const absl::StatusOr<PushResult>& result = done.get();
    if (!result.ok() && first.ok()) first = result.status();
  }
  return first;
}

namespace {

// Calls `rpc` (one attempt: a gRPC status) by platform::kGradientPush until
// it succeeds, fails with a code no retry helps, or `deadline` passes.
// GetGradientNorm is also retried by gRPC itself (kUnaryCall); its 4 quick
// attempts cannot wait out a shard's restart, which these can.
absl::Status WithRetries(const std::string& who, std::chrono::steady_clock::time_point deadline,
                         const std::function<grpc::Status(grpc::ClientContext&)>& rpc) {
  return platform::Retry(platform::kGradientPush, deadline, [&](int) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         (deadline - std::chrono::steady_clock::now()));
    return wire::FromGrpcStatus(rpc(context), who);
  });
}

}  // namespace

void GradientSink::AddWorkerToken(grpc::ClientContext& context) const {
  if (!options_.worker_token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.worker_token));
  }
}

absl::StatusOr<GradientSink::StepEnd> GradientSink::FinishStep(uint64_t step) {
  RETURN_IF_ERROR(Flush());
  StepEnd end;
  if (options_.worker != 0) return end;
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  const auto num_shards = static_cast<uint32_t>(shards_.addresses().size());
  double sum_of_squares = 0, max_norm = 0;
  std::optional<float> applied;
  for (uint32_t shard = 0; shard < num_shards && !applied; ++shard) {
    const std::string who = absl::StrCat("shard ", shard, " (", shards_.addresses()[shard], ")");
    std::chrono::milliseconds poll(2);
    for (;;) {
      layercast::v1::GetGradientNormRequest request;
      request.set_step(step);
      layercast::v1::GetGradientNormResponse response;
      RETURN_IF_ERROR(WithRetries(who, deadline, [&](grpc::ClientContext& context) {
        return shards_.stub(shard).GetGradientNorm(&context, request, &response);
      }));
      if (response.clip_max_norm() == 0) {
        if (shard == 0) return end;  // the shards do not clip: steps applied with their pushes
        return absl::FailedPreconditionError(absl::StrCat(
            who,
            " does not clip gradients but shard 0 does: start every shard with the same "
            "--optimizer"));
      }
      max_norm = response.clip_max_norm();
      if (response.has_applied_scale()) {
        applied = response.applied_scale();
        break;
      }
      if (response.ready()) {
        sum_of_squares += response.sum_of_squares();
        break;
      }
      if (std::chrono::steady_clock::now() + poll >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(who, " still waits for pushes of step ", step, " to layers ",
                         absl::StrJoin(response.waiting_layers(), ","),
                         " after the sink's timeout: a data-parallel worker is missing or stuck"));
      }
      std::this_thread::sleep_for(poll);
      poll = std::min(poll * 2, std::chrono::milliseconds(50));
    }
  }
  end.clipped = true;
  end.total_norm = std::sqrt(sum_of_squares);
  end.scale = applied ? *applied : ClipScale(end.total_norm, max_norm);
  for (uint32_t shard = 0; shard < num_shards; ++shard) {
    const std::string who = absl::StrCat("shard ", shard, " (", shards_.addresses()[shard], ")");
    layercast::v1::ApplyClippedStepRequest request;
    request.set_step(step);
    request.set_scale(end.scale);
    layercast::v1::ApplyClippedStepResponse response;
    RETURN_IF_ERROR(WithRetries(who, deadline, [&](grpc::ClientContext& context) {
      AddWorkerToken(context);
      return shards_.stub(shard).ApplyClippedStep(&context, request, &response);
    }));
  }
  return end;
}

void GradientSink::RunShard(uint32_t shard) {
  for (;;) {
    std::shared_ptr<Task> task;
    {
      absl::MutexLock lock(&mu_);
      const auto ready = [this, shard]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queues_[shard].empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queues_[shard].empty()) return;  // stopping, and nothing is left
      task = queues_[shard].front();
      queues_[shard].pop_front();
    }
    Settle(*task, shard, PushToShard(shard, *task));
  }
}

absl::StatusOr<layercast::v1::PushGradientsResponse> GradientSink::PushToShard(uint32_t shard,
                                                                               const Task& task) {
  const wire::ShardSetView& view = shards_.view();
  const auto num_shards = static_cast<uint32_t>(shards_.addresses().size());
  const std::string describe = absl::StrCat("shard ", shard, " (", shards_.addresses()[shard], ")");
  // Not gRPC's retry policy: it retries a client stream only while what was
  // sent fits its retry buffer (256 KiB), and a layer's gradient does not.
  layercast::v1::PushGradientsResponse response;
  int attempts = 0;
  const absl::Status status =
      platform::Retry(platform::kGradientPush, task.deadline, [&](int attempt) -> absl::Status {
        attempts = attempt;
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() +
                             (task.deadline - std::chrono::steady_clock::now()));
        AddWorkerToken(context);
        response.Clear();
        std::unique_ptr<grpc::ClientWriter<layercast::v1::GradientChunk>> writer =
            shards_.stub(shard).PushGradients(&context, &response);
        wire::GradientChunker chunker(
            view.gradient_layouts[task.layer],
            std::span<const uint8_t>(task.gradient.data(), task.gradient.size()),
            {task.step, options_.worker, task.layer, shard, num_shards}, options_.chunk_bytes);
        layercast::v1::GradientChunk chunk;
        uint64_t sent = 0;
        while (chunker.Next(&chunk)) {
          if (!writer->Write(chunk)) break;  // the shard ended the call: Finish says why
          sent += chunk.data().size();
        }
        writer->WritesDone();
        const absl::Status pushed = wire::FromGrpcStatus(writer->Finish(), describe);
        {
          absl::MutexLock lock(&mu_);
          bytes_pushed_ += sent;
        }
        if (pushed.code() != absl::StatusCode::kAlreadyExists) return pushed;
        // The push counted once already, which is what was asked: an
        // earlier attempt that failed on its way back did arrive, or this
        // worker pushed the layer before it died and was restarted with its
        // index, and now pushes the step again to rejoin it (the layers it
        // had not pushed complete the step).
        if (attempt == 1) {
          Log()->info(
              "layer {} of step {} counted already on {} (this worker pushed it before a "
              "restart; if it did not, another process uses worker index {})",
              task.layer, task.step, describe, options_.worker);
        }
        response.set_layer_version(task.step);
        response.set_applied(false);
        return absl::OkStatus();
      });
  if (status.ok()) return response;
  return absl::Status(
      status.code(),
      absl::StrCat("pushing the gradient of layer ", task.layer, " (step ", task.step, ") to ",
                   status.message(),
                   attempts > 1 ? absl::StrCat(" (after ", attempts, " attempts)") : ""));
}

void GradientSink::Settle(Task& task, uint32_t,
                          absl::StatusOr<layercast::v1::PushGradientsResponse> result) {
  bool last = false;
  {
    absl::MutexLock lock(&mu_);
    if (!result.ok()) {
      if (task.failure.ok()) task.failure = result.status();
    } else {
      task.result.layer_version = std::min(task.result.layer_version, result->layer_version());
      task.result.applied = task.result.applied && result->applied();
      task.result.shards_applied += result->applied() ? 1 : 0;
    }
    last = --task.remaining == 0;
    if (last) bytes_in_flight_ -= task.gradient.size();
  }
  if (!last) return;
  if (task.failure.ok()) {
    task.promise.set_value(task.result);
  } else {
    task.promise.set_value(task.failure);
  }
}

}  // namespace layercast::client
