#include "client/gpu/nccl_layer_gatherer.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "client/gpu/cuda_status.h"
#include "core/dtype.h"
#include "platform/status_macros.h"

namespace layercast::gpu {
namespace {

// What a rank all-gathers in place of a version when it has none to give.
constexpr uint64_t kNoPart = UINT64_MAX;      // its range of this layer is empty
constexpr uint64_t kFailed = UINT64_MAX - 1;  // its landing failed (its own status says why)

}  // namespace

AllGatherSplit SplitForAllGather(uint64_t total, uint32_t nranks) {
  AllGatherSplit split;
  if (nranks == 0) return split;
  const uint64_t units = (total + kAssembledAlignment - 1) / kAssembledAlignment;
  split.part_bytes = (units + nranks - 1) / nranks * kAssembledAlignment;
  split.buffer_bytes = split.part_bytes * nranks;
  for (uint32_t r = 0; r < nranks; ++r) {
    split.ranges.emplace_back(std::min(total, r * split.part_bytes),
                              std::min(total, (r + 1) * split.part_bytes));
  }
  return split;
}

absl::Status CheckAllGatherable(uint32_t layer, const LayerSpec& spec,
                                const AssembledLayout& layout, uint32_t nranks) {
  if (nranks <= 1 || layout.total_bytes() == 0) return absl::OkStatus();
  const uint64_t part = SplitForAllGather(layout.total_bytes(), nranks).part_bytes;
  for (size_t t = 0; t < layout.tensors().size(); ++t) {
    const AssembledTensor& placed = layout.tensors()[t];
    if (placed.block_size == 0 || placed.num_elements == 0) continue;
    // Codes, then their scales: complete only when one part holds both.
    const uint64_t first = placed.byte_offset;
    const uint64_t last = placed.scale_offset + placed.scale_bytes() - 1;
    if (first / part == last / part) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " (", spec.name, ") has tensor ", spec.tensors[t].name, " in ",
        DTypeName(placed.compute_dtype), " across the parts of ", nranks,
        " ranks, which cannot all-gather its block scales (a rank receives the scales of the "
        "codes it fetches, and they lie in another rank's part): serve it 16-bit with a policy "
        "override ahead of any other that matches it (the first match wins), e.g. '",
        spec.tensors[t].name,
        "=bfloat16', or land the layer with one rank per node "
        "(DeviceGatherer)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NcclLayerGatherer>> NcclLayerGatherer::Create(
    const client::LayerSource& source, NcclComm& comm, DeviceGathererOptions options) {
  options.device = comm.device();
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceGatherer> gatherer,
                   DeviceGatherer::Create(source, options));
  const uint64_t version_bytes = sizeof(uint64_t) * comm.nranks();
  ASSIGN_OR_RETURN(PinnedBuffer host_versions, PinnedBuffer::Allocate(version_bytes));
  DeviceGuard guard(comm.device());
  RETURN_IF_ERROR(guard.status());
  void* versions = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&versions, version_bytes), "cudaMalloc (rank versions)");
  return std::unique_ptr<NcclLayerGatherer>(
      new NcclLayerGatherer(comm, std::move(gatherer), versions, std::move(host_versions)));
}

NcclLayerGatherer::~NcclLayerGatherer() {
  DeviceGuard guard(comm_.device());
  cudaStreamSynchronize(gatherer_->stream());
  cudaFree(versions_);
  cudaGetLastError();
}

uint64_t NcclLayerGatherer::DeviceBytes(uint32_t layer) const {
  const uint64_t total = source().view().layouts[layer].total_bytes();
  return total == 0 ? 0
                    : SplitForAllGather(total, static_cast<uint32_t>(comm_.nranks())).buffer_bytes;
}

absl::StatusOr<uint64_t> NcclLayerGatherer::Land(uint32_t layer,
                                                 const client::GatherOptions& options, void* dst) {
  const auto& layouts = source().view().layouts;
  if (layer >= layouts.size()) {
    return absl::NotFoundError(absl::StrCat("layer ", layer, " does not exist: this model has ",
                                            layouts.size(), " layers"));
  }
  const uint64_t total = layouts[layer].total_bytes();
  // Every rank derives the same layout, so all skip the collective together,
  // and all refuse a layer they cannot complete before any of them fetches.
  if (total == 0) return gatherer_->Land(layer, options, dst);
  RETURN_IF_ERROR(CheckAllGatherable(layer, source().view().model.layers[layer], layouts[layer],
                                     static_cast<uint32_t>(comm_.nranks())));

  const int rank = comm_.rank();
  const int nranks = comm_.nranks();
  const AllGatherSplit split = SplitForAllGather(total, static_cast<uint32_t>(nranks));
  const auto [begin, end] = split.ranges[rank];
  uint8_t* const layer_bytes = static_cast<uint8_t*>(dst);

  // This rank's part, landed in place.
  absl::Status landed;
  uint64_t mine = kNoPart;
  if (begin < end) {
    absl::StatusOr<uint64_t> version =
        gatherer_->LandRange(layer, options, begin, end, layer_bytes + begin);
    if (version.ok()) {
      mine = *version;
      fetched_bytes_ += end - begin;
    } else {
      landed = version.status();
      mine = kFailed;
    }
  }

  DeviceGuard guard(comm_.device());
  RETURN_IF_ERROR(guard.status());
  cudaStream_t stream = gatherer_->stream();
  auto* host = reinterpret_cast<uint64_t*>(host_versions_.data());
  auto* versions = static_cast<uint64_t*>(versions_);
  host[rank] = mine;
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(versions + rank, host + rank, sizeof(uint64_t),
                                       cudaMemcpyHostToDevice, stream),
                       "cudaMemcpyAsync (this rank's version)");
  // Even when this rank's landing failed: the others are waiting in the same
  // collective, and skipping it would leave them to time out.
  const NcclComm::AllGatherPart parts[] = {
      {layer_bytes + rank * split.part_bytes, layer_bytes, split.part_bytes},
      {versions + rank, versions, sizeof(uint64_t)},
  };
  RETURN_IF_ERROR(comm_.AllGather(parts, stream, options.timeout));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, versions, sizeof(uint64_t) * nranks, cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync (every rank's version)");
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "cudaStreamSynchronize");

  RETURN_IF_ERROR(landed);
  std::optional<uint64_t> version;
  for (int r = 0; r < nranks; ++r) {
    if (host[r] == kFailed) {
      return absl::AbortedError(absl::StrCat("layer ", layer, ": rank ", r, " of ", nranks,
                                             " failed to land its part (its own error says why)"));
    }
    if (host[r] == kNoPart) continue;
    if (version && *version != host[r]) {
      return absl::AbortedError(absl::StrCat(
          "layer ", layer, ": ranks landed their parts from different parameter versions (",
          *version, " and ", host[r], " on rank ", r, "); retry with min_version ",
          std::max(*version, host[r])));
    }
    version = host[r];
  }
  return version.value_or(0);
}

}  // namespace layercast::gpu
