// Landing layers on the GPU, against baselines measured in the same run, over
// real shard servers on 127.0.0.1 (layercast-shard processes):
//   1. host-to-device landing: the DeviceGatherer's staging -> device pipeline
//      (pieces, cudaMemcpyAsync, events) against one plain cudaMemcpy of the
//      same bytes from pinned memory (goal: >= 0.8x); and a whole landing from
//      the shards against a host-only gather of the same layers (the copies
//      should hide behind the gather: ~1x);
//   2. a forward/backward walk through a DeviceLayerStream with simulated
//      compute (a host function that occupies the compute stream for
//      --compute-ms per layer, after cudaStreamWaitEvent on the layer): how
//      long the compute stream sat idle waiting for layers, landing on demand
//      against prefetching under the budget.
//
// Usage: gpu_landing_bench [--num-shards N] [--synthetic SPEC] [--piece-mib M]
//                          [--compute-ms MS] [--budget-layers K] [--repeat R]
//                          [--require-gpu]
// Without a CUDA device it prints "gpu_landing_bench: skipped: no CUDA device:
// ..." and exits 0, or 1 with --require-gpu (scripts/gpu-check.sh).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/gpu/cuda_handles.h"
#include "client/gpu/cuda_status.h"
#include "client/gpu/device_gatherer.h"
#include "client/gpu/device_layer_stream.h"
#include "client/layer_stream.h"
#include "client/shard_set.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "tools/local_shard_set.h"

namespace layercast {
namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  uint32_t num_shards = 2;
  std::string synthetic = "llama:layers=8,hidden=2048,ffn=5632,vocab=32000,seed=2";
  uint64_t piece_mib = 16;
  int compute_ms = 30;
  uint64_t budget_layers = 3;
  int repeat = 5;
  bool require_gpu = false;
};

Args ParseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--require-gpu") {
      args.require_gpu = true;
      continue;
    }
    if (i + 1 >= argc) break;
    const std::string value = argv[++i];
    if (flag == "--num-shards") args.num_shards = static_cast<uint32_t>(std::stoul(value));
    if (flag == "--synthetic") args.synthetic = value;
    if (flag == "--piece-mib") args.piece_mib = std::stoull(value);
    if (flag == "--compute-ms") args.compute_ms = std::stoi(value);
    if (flag == "--budget-layers") args.budget_layers = std::stoull(value);
    if (flag == "--repeat") args.repeat = std::stoi(value);
  }
  return args;
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double GBps(uint64_t bytes, double seconds) { return bytes / seconds / 1e9; }

// The shard set's layers, "gathered" by doing nothing: the staging already
// holds whatever it holds. Lets the bench time the gatherer's own pipeline
// (pieces, copies, events) without a network in front of it.
class PreStagedSource final : public client::LayerSource {
 public:
  explicit PreStagedSource(const client::LayerSource& real) : real_(real) {}
  const wire::ShardSetView& view() const override { return real_.view(); }
  absl::StatusOr<uint64_t> GatherInto(uint32_t, const client::GatherOptions&,
                                      std::span<uint8_t>) const override {
    return 0;
  }
  client::ClientMetrics* metrics() const override { return nullptr; }

 private:
  const client::LayerSource& real_;
};

// Plain pinned cudaMemcpy of `bytes`, best of `repeat`: the baseline.
absl::StatusOr<double> PlainCopySeconds(uint64_t bytes, int repeat, cudaStream_t stream) {
  ASSIGN_OR_RETURN(gpu::PinnedBuffer host, gpu::PinnedBuffer::Allocate(bytes));
  std::memset(host.data(), 1, bytes);
  void* device = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device, bytes), "cudaMalloc");
  double best = 1e30;
  for (int i = 0; i <= repeat; ++i) {  // the first is a warm-up
    const auto start = Clock::now();
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device, host.data(), bytes, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync");
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (i > 0) best = std::min(best, Seconds(start));
  }
  cudaFree(device);
  return best;
}

// One landing of `layer` by `lander`, waited for; best of `repeat`.
absl::StatusOr<double> LandingSeconds(gpu::DeviceLander& lander, uint32_t layer, int repeat) {
  void* device = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device, lander.DeviceBytes(layer)), "cudaMalloc");
  double best = 1e30;
  for (int i = 0; i <= repeat; ++i) {
    const auto start = Clock::now();
    RETURN_IF_ERROR(lander.Land(layer, {}, device).status());
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lander.stream()), "cudaStreamSynchronize");
    if (i > 0) best = std::min(best, Seconds(start));
  }
  cudaFree(device);
  return best;
}

// Every layer gathered into pinned host memory, no device: seconds per pass.
absl::StatusOr<double> HostGatherSeconds(const client::ShardSet& set, uint64_t largest) {
  ASSIGN_OR_RETURN(gpu::PinnedBuffer host, gpu::PinnedBuffer::Allocate(largest));
  const auto start = Clock::now();
  for (uint32_t layer = 0; layer < set.model().layers.size(); ++layer) {
    RETURN_IF_ERROR(
        set.GatherInto(layer, {}, std::span<uint8_t>(host.data(), host.size())).status());
  }
  return Seconds(start);
}

// Every layer landed on the device from the shards: seconds per pass.
absl::StatusOr<double> DeviceLandingSeconds(gpu::DeviceGatherer& gatherer, uint32_t num_layers,
                                            uint64_t largest) {
  void* device = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device, largest), "cudaMalloc");
  const auto start = Clock::now();
  for (uint32_t layer = 0; layer < num_layers; ++layer) {
    RETURN_IF_ERROR(gatherer.Land(layer, {}, device).status());
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(gatherer.stream()), "cudaStreamSynchronize");
  const double seconds = Seconds(start);
  cudaFree(device);
  return seconds;
}

struct Walk {
  double seconds = 0;           // host wall time of the step
  double compute_seconds = 0;   // simulated compute enqueued
  double stream_seconds = 0;    // compute stream, first event to last
  double idle_seconds = 0;      // stream_seconds - compute_seconds: waiting for layers
  double gpu_wait_seconds = 0;  // of which inside cudaStreamWaitEvent on a layer
  double host_wait_seconds = 0;
  uint64_t hits = 0, misses = 0, peak = 0, pool_high = 0, pool_used_high = 0;
};

void Compute(void* milliseconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(milliseconds)));
}

absl::StatusOr<Walk> DeviceWalk(gpu::DeviceGatherer& gatherer, uint64_t budget, uint32_t lookahead,
                                int compute_ms) {
  const uint32_t n = static_cast<uint32_t>(gatherer.source().view().layouts.size());
  gpu::DeviceLayerStreamOptions options;
  options.order = client::ForwardBackwardOrder(n);
  options.budget_bytes = budget;
  options.max_lookahead = lookahead;
  ASSIGN_OR_RETURN(gpu::CudaStream compute, gpu::CudaStream::Create());
  // Timing events on the compute stream: the walk's start and end, and
  // around each cudaStreamWaitEvent on a layer.
  ASSIGN_OR_RETURN(gpu::CudaEvent begin_walk, gpu::CudaEvent::Create(/*timing=*/true));
  ASSIGN_OR_RETURN(gpu::CudaEvent end_walk, gpu::CudaEvent::Create(/*timing=*/true));
  std::vector<gpu::CudaEvent> wait_begin, wait_end;
  for (size_t i = 0; i < options.order.size(); ++i) {
    ASSIGN_OR_RETURN(gpu::CudaEvent b, gpu::CudaEvent::Create(/*timing=*/true));
    ASSIGN_OR_RETURN(gpu::CudaEvent e, gpu::CudaEvent::Create(/*timing=*/true));
    wait_begin.push_back(std::move(b));
    wait_end.push_back(std::move(e));
  }
  static int compute_ms_for_host_func;
  compute_ms_for_host_func = compute_ms;

  Walk walk;
  const auto start = Clock::now();
  ASSIGN_OR_RETURN(std::unique_ptr<gpu::DeviceLayerStream> stream,
                   gpu::DeviceLayerStream::Create(gatherer, options));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(begin_walk.get(), compute.get()), "cudaEventRecord");
  for (size_t i = 0; i < options.order.size(); ++i) {
    ASSIGN_OR_RETURN(gpu::DeviceLayer layer, stream->Next());
    CUDA_RETURN_IF_ERROR(cudaEventRecord(wait_begin[i].get(), compute.get()), "cudaEventRecord");
    RETURN_IF_ERROR(layer.WaitOn(compute.get()));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(wait_end[i].get(), compute.get()), "cudaEventRecord");
    CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(compute.get(), Compute, &compute_ms_for_host_func),
                         "cudaLaunchHostFunc");
    // The layer is dropped at the end of this iteration, long before its
    // compute has run: RecordUse keeps its memory until then.
    RETURN_IF_ERROR(layer.RecordUse(compute.get()));
  }
  CUDA_RETURN_IF_ERROR(cudaEventRecord(end_walk.get(), compute.get()), "cudaEventRecord");
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize");
  walk.seconds = Seconds(start);
  float ms = 0;
  CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, begin_walk.get(), end_walk.get()),
                       "cudaEventElapsedTime");
  walk.stream_seconds = ms / 1e3;
  walk.compute_seconds = options.order.size() * compute_ms / 1e3;
  walk.idle_seconds = std::max(0.0, walk.stream_seconds - walk.compute_seconds);
  for (size_t i = 0; i < options.order.size(); ++i) {
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, wait_begin[i].get(), wait_end[i].get()),
                         "cudaEventElapsedTime");
    walk.gpu_wait_seconds += ms / 1e3;
  }
  const gpu::DeviceLayerStreamStats stats = stream->stats();
  walk.host_wait_seconds = stats.wait_seconds;
  walk.hits = stats.hits;
  walk.misses = stats.misses;
  walk.peak = stats.peak_bytes;
  walk.pool_high = stats.pool_reserved_high_bytes;
  walk.pool_used_high = stats.pool_used_high_bytes;
  return walk;
}

absl::Status Run(const Args& args) {
  cudaDeviceProp prop = {};
  CUDA_RETURN_IF_ERROR(cudaSetDevice(0), "cudaSetDevice(0)");
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  tools::LocalShardSet::Options shard_options;
  shard_options.shard_binary = LAYERCAST_SHARD_BINARY;
  shard_options.num_shards = args.num_shards;
  shard_options.extra_flags = {"--synthetic", args.synthetic};
  shard_options.log_dir = "/tmp";
  ASSIGN_OR_RETURN(std::unique_ptr<tools::LocalShardSet> shards,
                   tools::LocalShardSet::Start(shard_options));
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::minutes(3);
  ASSIGN_OR_RETURN(std::unique_ptr<client::ShardSet> set,
                   client::ShardSet::Connect(shards->addresses(), connect));
  const uint32_t n = static_cast<uint32_t>(set->model().layers.size());
  uint64_t largest = 0, total = 0;
  uint32_t largest_layer = 0;
  for (uint32_t l = 0; l < n; ++l) {
    const uint64_t bytes = set->view().layouts[l].total_bytes();
    total += bytes;
    if (bytes > largest) largest = bytes, largest_layer = l;
  }
  std::printf("device 0: %s, %.1f GiB; model %s, %u shards, %u layers (largest %s, all %s)\n",
              prop.name, prop.totalGlobalMem / double(1ull << 30), set->model().model_id.c_str(),
              args.num_shards, n, FormatBytes(largest).c_str(), FormatBytes(total).c_str());

  gpu::DeviceGathererOptions options;
  options.piece_bytes = args.piece_mib << 20;
  ASSIGN_OR_RETURN(std::unique_ptr<gpu::DeviceGatherer> gatherer,
                   gpu::DeviceGatherer::Create(*set, options));
  PreStagedSource prestaged(*set);
  ASSIGN_OR_RETURN(std::unique_ptr<gpu::DeviceGatherer> pipeline,
                   gpu::DeviceGatherer::Create(prestaged, options));

  std::printf("\n== host-to-device landing (%s pieces, best of %d)\n",
              FormatBytes(options.piece_bytes).c_str(), args.repeat);
  ASSIGN_OR_RETURN(const double plain, PlainCopySeconds(largest, args.repeat, gatherer->stream()));
  ASSIGN_OR_RETURN(const double piped, LandingSeconds(*pipeline, largest_layer, args.repeat));
  std::printf("plain pinned cudaMemcpy, %s:              %7.2f GB/s\n",
              FormatBytes(largest).c_str(), GBps(largest, plain));
  std::printf("landing pipeline (staging -> device), same:  %7.2f GB/s\n", GBps(largest, piped));
  std::printf("landing / plain cudaMemcpy:                  %7.3f  (goal >= 0.8)\n", plain / piped);

  ASSIGN_OR_RETURN(const double host_pass, HostGatherSeconds(*set, largest));  // warm-up
  double host_best = host_pass, device_best = 1e30;
  for (int i = 0; i < std::max(1, args.repeat / 2); ++i) {
    ASSIGN_OR_RETURN(const double h, HostGatherSeconds(*set, largest));
    ASSIGN_OR_RETURN(const double d, DeviceLandingSeconds(*gatherer, n, largest));
    host_best = std::min(host_best, h);
    device_best = std::min(device_best, d);
  }
  std::printf("host gather from %u shards (no device):      %7.2f GB/s\n", args.num_shards,
              GBps(total, host_best));
  std::printf("device landing from %u shards:               %7.2f GB/s\n", args.num_shards,
              GBps(total, device_best));
  std::printf("device landing / host gather:                %7.3f  (copies hidden: ~1)\n",
              host_best / device_best);

  const uint64_t budget = args.budget_layers * largest;
  std::printf(
      "\n== forward/backward walk, %d ms simulated compute per layer, budget %s "
      "(%llu largest layers)\n",
      args.compute_ms, FormatBytes(budget).c_str(),
      static_cast<unsigned long long>(args.budget_layers));
  ASSIGN_OR_RETURN(const Walk on_demand, DeviceWalk(*gatherer, budget, 0, args.compute_ms));
  ASSIGN_OR_RETURN(const Walk prefetch, DeviceWalk(*gatherer, budget, UINT32_MAX, args.compute_ms));
  std::printf("%-12s %8s %9s %12s %10s %10s %8s %12s %12s %12s\n", "mode", "step s", "compute s",
              "stream idle", "GPU wait", "host wait", "hits", "peak", "pool used", "pool high");
  for (const auto& [name, w] :
       {std::pair{"on demand", on_demand}, std::pair{"prefetch", prefetch}}) {
    std::printf("%-12s %8.3f %9.3f %12.3f %10.3f %10.3f %4llu/%-3llu %12s %12s %12s\n", name,
                w.seconds, w.compute_seconds, w.idle_seconds, w.gpu_wait_seconds,
                w.host_wait_seconds, static_cast<unsigned long long>(w.hits),
                static_cast<unsigned long long>(w.hits + w.misses), FormatBytes(w.peak).c_str(),
                FormatBytes(w.pool_used_high).c_str(), FormatBytes(w.pool_high).c_str());
  }
  std::printf("compute stream idle, prefetch / on demand:   %7.3f\n",
              prefetch.idle_seconds / std::max(1e-9, on_demand.idle_seconds));
  std::printf("device peak tracked / budget:                %7.3f\n",
              static_cast<double>(prefetch.peak) / budget);
  std::printf("device pool reserved high / budget:          %7.3f\n",
              static_cast<double>(prefetch.pool_high) / budget);
  return shards->Stop();
}

}  // namespace
}  // namespace layercast

int main(int argc, char** argv) {
  const layercast::Args args = layercast::ParseArgs(argc, argv);
  const absl::StatusOr<int> devices = layercast::gpu::CudaDeviceCount();
  if (!devices.ok()) {
    std::printf("gpu_landing_bench: skipped: %s\n",
                std::string(devices.status().message()).c_str());
    return args.require_gpu ? 1 : 0;
  }
  const absl::Status status = layercast::Run(args);
  if (!status.ok()) {
    std::fprintf(stderr, "gpu_landing_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
