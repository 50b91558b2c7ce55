#include "programs/layercast/layer_walk.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::cli {
namespace {

std::string Bar(size_t done, size_t total, size_t width) {
  const size_t filled = total == 0 ? width : done * width / total;
  return std::string(filled, '#') + std::string(width - filled, '.');
}

}  // namespace

uint64_t LayersBudget(const client::ShardSet& set, uint64_t layers) {
  uint64_t largest = 0;
  for (const AssembledLayout& layout : set.view().layouts) {
    largest = std::max(largest, layout.total_bytes());
  }
  return layers * largest;
}

absl::StatusOr<WalkStats> WalkLayers(const client::ShardSet& set,
                                     const std::vector<uint32_t>& order, uint64_t budget_bytes,
                                     const std::function<const char*(size_t step)>& label,
                                     const std::function<absl::Status(const client::Layer&)>& use) {
  const bool terminal = isatty(STDERR_FILENO) != 0;
  client::LayerStreamOptions options;
  options.order = order;
  options.budget_bytes = budget_bytes;
  ASSIGN_OR_RETURN(auto stream, client::LayerStream::Create(set, options));
  WalkStats stats;
  const auto start = std::chrono::steady_clock::now();
  for (size_t step = 0; step < order.size(); ++step) {
    ASSIGN_OR_RETURN(client::Layer layer, stream->Next());
    uint64_t wire = 0, fp32 = 0;
    for (size_t t = 0; t < layer.num_tensors(); ++t) {
      wire += layer.tensor(t).bytes.size();
      fp32 += layer.tensor(t).num_elements * sizeof(float);
    }
    RETURN_IF_ERROR(use(layer));
    stats.layers++;
    stats.wire_bytes += wire;
    stats.fp32_bytes += fp32;
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Off a terminal (a log file, CI) a line per tenth of the walk, not one
    // per layer.
    const size_t done = step + 1;
    if (!terminal && done != order.size() && done * 10 / order.size() == step * 10 / order.size()) {
      continue;
    }
    std::fprintf(stderr, "%s[%s] %3zu/%zu %-8s layer %3u %-24s %10s  %6.2f GB/s so far%s",
                 terminal ? "\r" : "", Bar(step + 1, order.size(), 24).c_str(), step + 1,
                 order.size(), label(step), layer.index(), layer.name().c_str(),
                 FormatBytes(wire).c_str(), stats.wire_bytes / stats.seconds / 1e9,
                 terminal ? "" : "\n");
  }
  if (terminal) std::fputc('\n', stderr);
  stats.stream = stream->stats();
  return stats;
}

}  // namespace layercast::cli
