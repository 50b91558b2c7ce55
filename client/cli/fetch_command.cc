#include <cstdio>
#include <map>

#include "absl/strings/str_cat.h"
#include "client/cli/commands.h"
#include "client/cli/connect.h"
#include "core/byte_size.h"
#include "core/safetensors.h"
#include "core/status_macros.h"

namespace layercast::cli {

absl::Status RunFetch(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(CliFlags flags,
                   CliFlags::Parse(args, WithShardSetFlags({"layer", "out", "timeout-ms"})));
  if (!flags.Has("layer") || !flags.Has("out")) {
    return absl::InvalidArgumentError("--layer L and --out FILE.safetensors are required");
  }
  ASSIGN_OR_RETURN(uint64_t layer_index, flags.GetUint("layer", 0));
  ASSIGN_OR_RETURN(uint64_t timeout_ms, flags.GetUint("timeout-ms", 60000));
  ASSIGN_OR_RETURN(auto set, ConnectFromFlags(flags));
  if (layer_index >= set->model().layers.size()) {
    return absl::NotFoundError(absl::StrCat(
        "layer ", layer_index, " does not exist: the model has ", set->model().layers.size(),
        " layers (0-", set->model().layers.size() - 1, ")"));
  }
  client::GatherOptions options;
  options.timeout = std::chrono::milliseconds(timeout_ms);
  // A shard restarting (a rolling update) is waited out until --timeout-ms;
  // say what the fetch waits for meanwhile.
  options.on_retry = [](const absl::Status& why, std::chrono::milliseconds delay) {
    std::fprintf(stderr, "layercast fetch: %s; retrying in %.1f s\n",
                 std::string(why.message()).c_str(), static_cast<double>(delay.count()) / 1000);
  };
  ASSIGN_OR_RETURN(client::Layer layer, set->Gather(static_cast<uint32_t>(layer_index), options));

  std::vector<SafetensorsWriter::TensorHeader> headers;
  for (size_t t = 0; t < layer.num_tensors(); ++t) {
    const client::Layer::TensorView view = layer.tensor(t);
    headers.push_back({std::string(view.name), view.dtype, {view.shape.begin(), view.shape.end()}});
  }
  const std::map<std::string, std::string> metadata = {
      {"model_id", set->model().model_id},
      {"layer", absl::StrCat(layer.index())},
      {"layer_name", layer.name()},
      {"version", absl::StrCat(layer.version())},
      {"policy", set->view().policy.ToString()},
  };
  const std::string out = flags.Get("out");
  ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::Create(out, headers, metadata));
  uint64_t bytes = 0;
  for (size_t t = 0; t < layer.num_tensors(); ++t) {
    RETURN_IF_ERROR(writer->Append(layer.tensor(t).bytes));
    bytes += layer.tensor(t).bytes.size();
  }
  RETURN_IF_ERROR(writer->Finish());
  std::printf("wrote layer %u (%s, %zu tensors, %s, version %llu) to %s\n", layer.index(),
              layer.name().c_str(), layer.num_tensors(), FormatBytes(bytes).c_str(),
              static_cast<unsigned long long>(layer.version()), out.c_str());
  return absl::OkStatus();
}

}  // namespace layercast::cli
