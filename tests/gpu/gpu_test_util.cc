#include "tests/gpu/gpu_test_util.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/gpu/device_layer_stream.h"
#include "client/gpu/nccl_comm.h"
#include "client/gpu/nccl_layer_gatherer.h"
#include "client/gpu/nccl_unique_id.h"
#include "client/layer_stream.h"
#include "platform/status_macros.h"

namespace layercast::gpu {

absl::Status ExpectDeviceBytes(const void* device, std::span<const uint8_t> host,
                               const std::string& what) {
  std::vector<uint8_t> back(host.size());
  CUDA_RETURN_IF_ERROR(cudaMemcpy(back.data(), device, back.size(), cudaMemcpyDeviceToHost),
                       absl::StrCat("cudaMemcpy back of ", what));
  if (std::memcmp(back.data(), host.data(), host.size()) == 0) return absl::OkStatus();
  size_t first = 0;
  while (back[first] == host[first]) ++first;
  return absl::DataLossError(absl::StrCat(what, ": device byte ", first, " of ", host.size(),
                                          " is ", back[first], ", the host gather has ",
                                          host[first]));
}

absl::Status ExpectLandingsMatchHost(const client::ShardSet& set, DeviceLander& lander) {
  DeviceGuard guard(lander.device());
  RETURN_IF_ERROR(guard.status());
  for (uint32_t layer = 0; layer < set.model().layers.size(); ++layer) {
    ASSIGN_OR_RETURN(client::Layer host, set.Gather(layer));
    void* device = nullptr;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&device, std::max<uint64_t>(1, lander.DeviceBytes(layer))),
                         "cudaMalloc");
    // Garbage first, so bytes the landing misses cannot match by luck; on
    // the lander's stream, which is not ordered with the default stream.
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(device, 0xA5, lander.DeviceBytes(layer), lander.stream()),
                         "cudaMemsetAsync");
    absl::StatusOr<uint64_t> version = lander.Land(layer, {}, device);
    absl::Status checked = version.status();
    if (checked.ok()) {
      checked = CudaStatus(cudaStreamSynchronize(lander.stream()), "cudaStreamSynchronize");
    }
    if (checked.ok() && *version != host.version()) {
      checked = absl::DataLossError(absl::StrCat("layer ", layer, " landed at version ", *version,
                                                 ", the host gather is at ", host.version()));
    }
    if (checked.ok()) {
      checked = ExpectDeviceBytes(device, host.bytes(), absl::StrCat("layer ", layer));
    }
    cudaFree(device);
    RETURN_IF_ERROR(checked);
  }
  return absl::OkStatus();
}

}  // namespace layercast::gpu

namespace layercast::gpu {

absl::Status RunNcclRank(int rank, int nranks, const std::string& id_file,
                         const std::vector<std::string>& shards, std::string* summary) {
  constexpr auto kTimeout = std::chrono::seconds(60);
  ASSIGN_OR_RETURN(const ncclUniqueId id, ShareNcclUniqueId(rank, id_file, kTimeout));
  ASSIGN_OR_RETURN(std::unique_ptr<NcclComm> comm,
                   NcclComm::Create(rank, nranks, id, /*device=*/rank, kTimeout));
  ASSIGN_OR_RETURN(std::unique_ptr<client::ShardSet> set, client::ShardSet::Connect(shards));
  ASSIGN_OR_RETURN(
      std::unique_ptr<NcclLayerGatherer> lander,
      NcclLayerGatherer::Create(*set, *comm, {.device = rank, .piece_bytes = 256 << 10}));
  RETURN_IF_ERROR(ExpectLandingsMatchHost(*set, *lander));

  const uint32_t n = static_cast<uint32_t>(set->model().layers.size());
  uint64_t mine = 0, all = 0, largest = 0;
  for (uint32_t layer = 0; layer < n; ++layer) {
    const uint64_t total = set->view().layouts[layer].total_bytes();
    const auto [begin, end] = SplitForAllGather(total, static_cast<uint32_t>(nranks)).ranges[rank];
    mine += end - begin;
    all += total;
    largest = std::max(largest, lander->DeviceBytes(layer));
  }
  if (lander->fetched_bytes() != mine) {
    return absl::InternalError(absl::StrCat("rank ", rank, " fetched ", lander->fetched_bytes(),
                                            " bytes from the shards, expected its part: ", mine));
  }

  // The same gatherer under the prefetching stream, forward and backward.
  DeviceGuard guard(rank);
  RETURN_IF_ERROR(guard.status());
  ASSIGN_OR_RETURN(CudaStream compute, CudaStream::Create());
  DeviceLayerStreamOptions options;
  options.order = client::ForwardBackwardOrder(n);
  options.budget_bytes = 2 * largest;
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceLayerStream> stream,
                   DeviceLayerStream::Create(*lander, options));
  std::vector<uint8_t> back(largest);
  for (uint32_t expected : options.order) {
    ASSIGN_OR_RETURN(DeviceLayer layer, stream->Next());
    ASSIGN_OR_RETURN(client::Layer host, set->Gather(expected));
    RETURN_IF_ERROR(layer.WaitOn(compute.get()));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(back.data(), layer.data(), layer.size(),
                                         cudaMemcpyDeviceToHost, compute.get()),
                         "cudaMemcpyAsync back");
    RETURN_IF_ERROR(layer.RecordUse(compute.get()));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize");
    if (layer.index() != expected || layer.size() != host.bytes().size() ||
        std::memcmp(back.data(), host.bytes().data(), layer.size()) != 0) {
      return absl::DataLossError(absl::StrCat("rank ", rank, ": layer ", expected,
                                              " from the device stream differs from the host"));
    }
  }
  *summary =
      absl::StrCat("rank ", rank, " of ", nranks, ": ", n, " layers bit-identical on device ", rank,
                   " (direct and streamed); ", "fetched ", mine, " of ", all, " assembled bytes");
  return absl::OkStatus();
}

}  // namespace layercast::gpu
