#pragma once

// Helpers shared by the GPU tests and the multi-process NCCL rank helper
// (which has no GoogleTest and no in-process servers).

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/gpu/cuda_status.h"
#include "client/gpu/device_lander.h"
#include "client/shard_set.h"

// Skips the test, saying why, where there is no usable CUDA device:
// "no CUDA device: cudaGetDeviceCount returned cudaErrorInsufficientDriver
// (...)" on machines with the toolkit but no driver, as CI.
#define LAYERCAST_SKIP_WITHOUT_GPU()                                                     \
  do {                                                                                   \
    const absl::StatusOr<int> _layercast_devices = ::layercast::gpu::CudaDeviceCount();  \
    if (!_layercast_devices.ok()) GTEST_SKIP() << _layercast_devices.status().message(); \
  } while (0)

namespace layercast::gpu {

// Copies `host.size()` bytes at device address `device` back and compares
// them with `host`: DATA_LOSS naming `what` and the first differing offset.
absl::Status ExpectDeviceBytes(const void* device, std::span<const uint8_t> host,
                               const std::string& what);

// For every layer of the source: lands it with `lander` into fresh device
// memory (cudaMalloc of DeviceBytes), waits, and compares its assembled bytes
// with the same layer gathered on the host by `set`.
absl::Status ExpectLandingsMatchHost(const client::ShardSet& set, DeviceLander& lander);

}  // namespace layercast::gpu

namespace layercast::gpu {

// One local rank of the hierarchical gather, end to end, as a worker process
// runs it: joins the communicator (rank r on device r, id through `id_file`),
// connects to the shard set at `shards`, lands every layer with
// NcclLayerGatherer and checks it against the host gather, checks that this
// rank fetched only its 1/K of each layer, then walks forward and backward
// through a DeviceLayerStream over the same gatherer, checking every layer
// again. On success `summary` says what was checked.
absl::Status RunNcclRank(int rank, int nranks, const std::string& id_file,
                         const std::vector<std::string>& shards, std::string* summary);

}  // namespace layercast::gpu
