#include "client/cli/layer_walk.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "core/byte_size.h"
#include "core/status_macros.h"

namespace layercast::cli {
namespace {

std::string Bar(size_t done, size_t total, size_t width) {
  const size_t filled = total == 0 ? width : done * width / total;
  return std::string(filled, '#') + std::string(width - filled, '.');
}

}  // namespace

absl::StatusOr<WalkStats> WalkLayers(const client::ShardSet& set,
                                     const std::vector<uint32_t>& order,
                                     const std::function<const char*(size_t step)>& label,
                                     const std::function<absl::Status(const client::Layer&)>& use) {
  const bool terminal = isatty(STDERR_FILENO) != 0;
  WalkStats stats;
  const auto start = std::chrono::steady_clock::now();
  for (size_t step = 0; step < order.size(); ++step) {
    const auto layer_start = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(client::Layer layer, set.Gather(order[step]));
    const double layer_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - layer_start).count();
    uint64_t wire = 0, fp32 = 0;
    for (size_t t = 0; t < layer.num_tensors(); ++t) {
      wire += layer.tensor(t).bytes.size();
      fp32 += layer.tensor(t).num_elements * sizeof(float);
    }
    RETURN_IF_ERROR(use(layer));
    stats.layers++;
    stats.wire_bytes += wire;
    stats.fp32_bytes += fp32;
    stats.max_layer_seconds = std::max(stats.max_layer_seconds, layer_seconds);
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "%s[%s] %3zu/%zu %-8s layer %3u %-24s %10s %6.2f GB/s%s",
                 terminal ? "\r" : "", Bar(step + 1, order.size(), 24).c_str(), step + 1,
                 order.size(), label(step), layer.index(), layer.name().c_str(),
                 FormatBytes(wire).c_str(), wire / layer_seconds / 1e9, terminal ? "" : "\n");
  }
  if (terminal) std::fputc('\n', stderr);
  return stats;
}

}  // namespace layercast::cli
