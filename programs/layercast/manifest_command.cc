#include <algorithm>
#include <cstdio>

#include "absl/strings/escaping.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"
#include "wire/incarnation.h"

namespace layercast::cli {

absl::Status RunManifest(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(tools::CliFlags flags, tools::CliFlags::Parse(args, kShardSetFlags));
  ASSIGN_OR_RETURN(auto set, ConnectFromFlags(flags));
  const layercast::v1::Manifest& manifest = set->manifests()[0];
  uint64_t elements = 0, assembled = 0;
  for (const auto& layer : manifest.layers()) {
    assembled += layer.assembled_bytes();
    for (const auto& tensor : layer.tensors()) elements += tensor.num_elements();
  }
  std::printf("model     %s\n", manifest.model_id().c_str());
  std::printf("shards    %u\n", manifest.num_shards());
  // Each shard's version and start: a split set, or a shard that restarted
  // (a new incarnation counts its versions from its start or checkpoint).
  uint64_t lowest = UINT64_MAX, highest = 0;
  for (size_t i = 0; i < set->manifests().size(); ++i) {
    const layercast::v1::Manifest& shard = set->manifests()[i];
    lowest = std::min<uint64_t>(lowest, shard.version());
    highest = std::max<uint64_t>(highest, shard.version());
    std::printf("  shard %zu  %s  version %llu, incarnation %s\n", i, set->addresses()[i].c_str(),
                static_cast<unsigned long long>(shard.version()),
                wire::IncarnationName(shard.incarnation()).c_str());
  }
  if (lowest != highest) {
    std::printf(
        "version   the shards disagree (%llu to %llu): a gather waits for one version on every "
        "shard and times out meanwhile. A shard behind restarted without its checkpoint: the "
        "next publish of every layer brings it level (a publish in progress settles by itself "
        "within seconds; docs/recovery.md)\n",
        static_cast<unsigned long long>(lowest), static_cast<unsigned long long>(highest));
  } else {
    std::printf("version   %llu\n", static_cast<unsigned long long>(manifest.version()));
  }
  std::printf("policy    %s\n", manifest.policy().c_str());
  std::printf("digest    %s\n", absl::BytesToHexString(manifest.layout_digest()).c_str());
  std::printf("params    %llu (%s fp32, %s assembled)\n", static_cast<unsigned long long>(elements),
              FormatBytes(elements * 4).c_str(), FormatBytes(assembled).c_str());
  std::printf("layers    %d\n", manifest.layers_size());
  for (const auto& layer : manifest.layers()) {
    std::printf("  %3u %-28s %3d tensors %12s\n", layer.index(), layer.name().c_str(),
                layer.tensors_size(), FormatBytes(layer.assembled_bytes()).c_str());
    for (const auto& tensor : layer.tensors()) {
      std::string shape;
      for (int64_t dim : tensor.shape()) shape += (shape.empty() ? "" : "x") + std::to_string(dim);
      std::printf("        %-48s %-9s [%s]\n", tensor.name().c_str(),
                  layercast::v1::DType_Name(tensor.compute_dtype()).c_str(), shape.c_str());
    }
  }
  return absl::OkStatus();
}

}  // namespace layercast::cli
