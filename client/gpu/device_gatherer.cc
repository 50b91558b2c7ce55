#include "client/gpu/device_gatherer.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "client/gpu/cuda_status.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::gpu {
namespace {

// The end of the staging bytes that gathering [begin, end) of `layout`
// writes: beyond `end` when it covers 8-bit float codes, whose blocks'
// scales come with them and lie after all the tensor's codes.
uint64_t WrittenEnd(const AssembledLayout& layout, uint64_t begin, uint64_t end) {
  uint64_t written = end;
  for (const AssembledTensor& tensor : layout.tensors()) {
    if (tensor.block_size != 0 && tensor.byte_offset < end &&
        begin < tensor.byte_offset + tensor.num_bytes()) {
      written = std::max(written, tensor.scale_offset + tensor.scale_bytes());
    }
  }
  return written;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceGatherer>> DeviceGatherer::Create(
    const client::LayerSource& source, DeviceGathererOptions options) {
  ASSIGN_OR_RETURN(const int count, CudaDeviceCount());
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", options.device,
                                                   " does not exist: this machine has ", count,
                                                   " (0-", count - 1, ")"));
  }
  options.piece_bytes =
      std::max<uint64_t>(kAssembledAlignment, (options.piece_bytes + kAssembledAlignment - 1) /
                                                  kAssembledAlignment * kAssembledAlignment);
  uint64_t largest = 0;
  for (const AssembledLayout& layout : source.view().layouts) {
    largest = std::max(largest, layout.total_bytes());
  }
  DeviceGuard guard(options.device);
  RETURN_IF_ERROR(guard.status());
  ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  ASSIGN_OR_RETURN(PinnedBuffer staging, PinnedBuffer::Allocate(largest));
  return std::unique_ptr<DeviceGatherer>(
      new DeviceGatherer(source, options, std::move(stream), std::move(staging)));
}

DeviceGatherer::~DeviceGatherer() {
  // The staging must outlive every copy that reads it.
  DeviceGuard guard(options_.device);
  cudaStreamSynchronize(stream_.get());
  cudaGetLastError();
}

uint64_t DeviceGatherer::DeviceBytes(uint32_t layer) const {
  return source_.view().layouts[layer].total_bytes();
}

absl::StatusOr<uint64_t> DeviceGatherer::Land(uint32_t layer, const client::GatherOptions& options,
                                              void* dst) {
  if (layer >= source_.view().layouts.size()) {
    return absl::NotFoundError(absl::StrCat("layer ", layer, " does not exist: this model has ",
                                            source_.view().layouts.size(), " layers"));
  }
  const uint64_t total = source_.view().layouts[layer].total_bytes();
  if (total == 0) {
    // Nothing to copy; the source still says which version the layer is.
    client::GatherOptions whole = options;
    whole.byte_range.reset();
    return source_.GatherInto(layer, whole, std::span<uint8_t>(staging_.data(), 0));
  }
  return LandRange(layer, options, 0, total, dst);
}

absl::StatusOr<uint64_t> DeviceGatherer::LandRange(uint32_t layer,
                                                   const client::GatherOptions& options,
                                                   uint64_t begin, uint64_t end, void* dst) {
  const auto& layouts = source_.view().layouts;
  if (layer >= layouts.size()) {
    return absl::NotFoundError(absl::StrCat("layer ", layer, " does not exist: this model has ",
                                            layouts.size(), " layers"));
  }
  const uint64_t total = layouts[layer].total_bytes();
  const auto valid_end = [&](uint64_t at) { return at % kAssembledAlignment == 0 || at == total; };
  if (begin >= end || end > total || !valid_end(begin) || !valid_end(end)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "byte range [", begin, ", ", end, ") of layer ", layer, " is not a non-empty range of ",
        "its ", total, " assembled bytes with both ends multiples of ", kAssembledAlignment));
  }
  DeviceGuard guard(options_.device);
  RETURN_IF_ERROR(guard.status());

  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  client::GatherOptions piece_options = options;
  std::optional<uint64_t> version;
  for (uint64_t piece = begin; piece < end; piece += options_.piece_bytes) {
    const uint64_t piece_end = std::min(end, piece + options_.piece_bytes);
    // A copy of the previous landing may still read the scales' bytes.
    RETURN_IF_ERROR(WaitForStaging(piece, WrittenEnd(layouts[layer], piece, piece_end)));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "landing layer ", layer, " on device ", options_.device, ": the ",
          options.timeout.count(), " ms timeout passed with ", FormatBytes(end - piece), " of ",
          FormatBytes(end - begin), " still to gather"));
    }
    piece_options.timeout = left;
    piece_options.byte_range = std::make_pair(piece, piece_end);
    ASSIGN_OR_RETURN(const uint64_t piece_version,
                     source_.GatherInto(layer, piece_options,
                                        std::span<uint8_t>(staging_.data(), staging_.size())));
    if (version && piece_version != *version) {
      return absl::AbortedError(absl::StrCat(
          "landing layer ", layer, ": the parameter version changed between pieces (", *version,
          " then ", piece_version, "); retry with min_version ", piece_version));
    }
    if (!version) {
      version = piece_version;
      // Later pieces must not come from an older step than the first.
      piece_options.min_version = std::max(piece_options.min_version, piece_version);
    }

    CudaEvent done;
    if (!spare_events_.empty()) {
      done = std::move(spare_events_.back());
      spare_events_.pop_back();
    } else {
      ASSIGN_OR_RETURN(done, CudaEvent::Create());
    }
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(static_cast<uint8_t*>(dst) + (piece - begin), staging_.data() + piece,
                        piece_end - piece, cudaMemcpyHostToDevice, stream_.get()),
        absl::StrCat("cudaMemcpyAsync of ", FormatBytes(piece_end - piece), " of layer ", layer,
                     " to device ", options_.device));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(done.get(), stream_.get()), "cudaEventRecord");
    pending_.push_back(PendingCopy{piece, piece_end, std::move(done)});
  }
  return *version;
}

absl::Status DeviceGatherer::WaitForStaging(uint64_t begin, uint64_t end) {
  // Copies complete in stream order: the newest one that overlaps is the one
  // to wait for, and everything before it is done once it is.
  for (size_t i = pending_.size(); i-- > 0;) {
    const PendingCopy& copy = pending_[i];
    if (copy.begin < end && begin < copy.end) {
      CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copy.done.get()),
                           "cudaEventSynchronize on a staging copy");
      Retire(i + 1);
      return absl::OkStatus();
    }
  }
  // Nothing overlaps; forget what has finished so the list stays short.
  size_t done = 0;
  while (done < pending_.size() && cudaEventQuery(pending_[done].done.get()) == cudaSuccess) {
    ++done;
  }
  cudaGetLastError();  // cudaErrorNotReady is not an error here
  Retire(done);
  return absl::OkStatus();
}

void DeviceGatherer::Retire(size_t count) {
  for (size_t i = 0; i < count; ++i) {
    spare_events_.push_back(std::move(pending_.front().done));
    pending_.pop_front();
  }
}

}  // namespace layercast::gpu
