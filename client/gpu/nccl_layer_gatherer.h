#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/gpu/cuda_handles.h"
#include "client/gpu/device_gatherer.h"
#include "client/gpu/device_lander.h"
#include "client/gpu/nccl_comm.h"
#include "core/layout.h"
#include "core/model.h"

namespace layercast::gpu {

// How K ranks split an assembled layer of `total` bytes so one in-place
// ncclAllGather completes it. ncclAllGather moves the same count from every
// rank, so every part is `part_bytes` = ceil(total / K) rounded up to
// kAssembledAlignment; rank r fetches [min(r*part, total), min((r+1)*part,
// total)) (valid for a byte-range fetch: both ends are 256-aligned or the
// layer's end). Unlike AssembledLayout::SplitBytes (nearly equal parts,
// unequal by up to 256 bytes), the padded layout then *is* the assembled
// layout: part r sits at r*part in both, so the all-gather writes every byte
// where it belongs and no compaction copy or scratch buffer is needed. Only
// the buffer grows, to K*part bytes (less than K*256 bytes of padding past
// the layer, which the last ranks send and receive as filler).
struct AllGatherSplit {
  uint64_t part_bytes = 0;
  uint64_t buffer_bytes = 0;                          // K * part_bytes
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // rank r's [begin, end); may be empty
};
AllGatherSplit SplitForAllGather(uint64_t total, uint32_t nranks);

// OK when `nranks` ranks can complete layer `layer`, `spec` laid out as
// `layout` (REQUIRES: the same tensors in the same order), by
// SplitForAllGather's parts. FAILED_PRECONDITION when an 8-bit float
// tensor's codes and scales span two parts: a rank that fetches some of its
// codes receives their blocks' scales into its staging, but they lie in
// another rank's part, which goes out with only that rank's scales; the
// message says to serve the tensor 16-bit or land with one rank.
absl::Status CheckAllGatherable(uint32_t layer, const LayerSpec& spec,
                                const AssembledLayout& layout, uint32_t nranks);

// Hierarchical gather for K local ranks, one process per GPU: rank r fetches
// only byte range r of K of each layer from the shard servers (through pinned
// staging, as DeviceGatherer does) and lands it in place, then one grouped
// NCCL all-gather completes the layer on every GPU. The wire carries each
// layer once per node instead of once per GPU.
//
// The same group also all-gathers each rank's parameter version, so every
// rank checks that the parts came from one version (ABORTED otherwise) and
// learns when another rank failed to land its part (ABORTED naming it): a
// rank whose fetch fails still takes part in the collective, so the ranks
// stay in step and the communicator stays usable. A rank that stops calling
// Land makes the others' all-gather fail at its deadline (DEADLINE_EXCEEDED;
// the communicator is then aborted).
//
// A layer with an 8-bit float tensor that one part cannot hold with its
// scales is refused by every rank before any fetches (CheckAllGatherable).
//
// Every rank must land the same layers in the same order. Not thread-safe.
class NcclLayerGatherer final : public DeviceLander {
 public:
  // `source` and `comm` must outlive the gatherer; `options.device` is
  // replaced by comm.device().
  static absl::StatusOr<std::unique_ptr<NcclLayerGatherer>> Create(
      const client::LayerSource& source, NcclComm& comm, DeviceGathererOptions options = {});
  ~NcclLayerGatherer() override;

  const client::LayerSource& source() const override { return gatherer_->source(); }
  int device() const override { return comm_.device(); }
  cudaStream_t stream() const override { return gatherer_->stream(); }
  uint64_t DeviceBytes(uint32_t layer) const override;
  absl::StatusOr<uint64_t> Land(uint32_t layer, const client::GatherOptions& options,
                                void* dst) override;

  // Bytes this rank fetched from the shard servers so far (its ranges only).
  uint64_t fetched_bytes() const { return fetched_bytes_; }

 private:
  NcclLayerGatherer(NcclComm& comm, std::unique_ptr<DeviceGatherer> gatherer, void* versions,
                    PinnedBuffer host_versions)
      : comm_(comm),
        gatherer_(std::move(gatherer)),
        versions_(versions),
        host_versions_(std::move(host_versions)) {}

  NcclComm& comm_;
  std::unique_ptr<DeviceGatherer> gatherer_;
  void* versions_;              // device: one uint64_t per rank
  PinnedBuffer host_versions_;  // host: the same, to read them back
  uint64_t fetched_bytes_ = 0;
};

}  // namespace layercast::gpu
