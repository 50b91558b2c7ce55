#include <cstdio>

#include "client/client_defaults.h"
#include "client/model_export.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"

namespace layercast::cli {

absl::Status RunExport(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(
          args, WithShardSetFlags({"out", "dtype", "version", "max-file-size", "timeout-ms"})));
  if (!flags.Has("out")) {
    return absl::InvalidArgumentError("--out FILE.safetensors is required");
  }
  client::ExportOptions options;
  options.path = flags.Get("out");
  ASSIGN_OR_RETURN(options.dtype, DTypeFromName(flags.Get("dtype", "float32")));
  if (flags.Has("version")) {
    ASSIGN_OR_RETURN(options.version, flags.GetUint("version", 0));
  }
  if (flags.Has("max-file-size")) {
    ASSIGN_OR_RETURN(options.max_file_bytes, ParseByteSize(flags.Get("max-file-size")));
  }
  ASSIGN_OR_RETURN(
      options.layer_timeout,
      TimeoutFromFlags(flags, "timeout-ms", static_cast<uint64_t>(client::kLayerTimeout.count())));
  ASSIGN_OR_RETURN(auto set, ConnectFromFlags(flags));
  const size_t layers = set->model().layers.size();
  options.on_layer = [layers](uint32_t layer, uint64_t bytes) {
    std::fprintf(stderr, "exported layer %u of %zu, %s\n", layer + 1, layers,
                 FormatBytes(bytes).c_str());
  };
  ASSIGN_OR_RETURN(const client::ExportResult result, client::ExportModel(*set, options));
  std::printf("exported %llu tensors (%s, %s) at version %llu to:\n",
              static_cast<unsigned long long>(result.tensors), FormatBytes(result.bytes).c_str(),
              std::string(DTypeName(options.dtype)).c_str(),
              static_cast<unsigned long long>(result.version));
  for (const std::string& file : result.files) std::printf("  %s\n", file.c_str());
  return absl::OkStatus();
}

}  // namespace layercast::cli
