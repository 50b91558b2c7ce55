#include <charconv>
#include <cstdio>
#include <map>

#include "absl/strings/str_cat.h"
#include "client/client_defaults.h"
#include "core/safetensors.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"

namespace layercast::cli {
namespace {

// A layer named by its index ("3") or its name ("model.layers.3").
absl::StatusOr<uint32_t> FindLayer(const ModelSpec& model, const std::string& text) {
  const uint64_t n = model.layers.size();
  uint64_t index = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), index);
  if (!text.empty() && error == std::errc() && end == text.data() + text.size()) {
    if (index < n) return static_cast<uint32_t>(index);
    return absl::NotFoundError(absl::StrCat("layer ", index, " does not exist: the model has ", n,
                                            " layers (0-", n - 1, ")"));
  }
  for (uint32_t l = 0; l < n; ++l) {
    if (model.layers[l].name == text) return l;
  }
  return absl::NotFoundError(absl::StrCat(
      "the model has no layer named '", text, "': give an index 0-", n - 1, " or a name such as ",
      n > 0 ? absl::StrCat("'", model.layers[0].name, "'") : std::string("..."),
      " (layercast manifest lists them)"));
}

}  // namespace

absl::Status RunFetch(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(tools::CliFlags flags,
                   tools::CliFlags::Parse(
                       args, WithShardSetFlags({"layer", "out", "timeout-ms", "verify-shards"})));
  if (!flags.Has("layer") || !flags.Has("out")) {
    return absl::InvalidArgumentError("--layer L and --out FILE.safetensors are required");
  }
  ASSIGN_OR_RETURN(
      const std::chrono::milliseconds timeout,
      TimeoutFromFlags(flags, "timeout-ms", static_cast<uint64_t>(client::kLayerTimeout.count())));
  ASSIGN_OR_RETURN(auto set, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(const uint32_t layer_index, FindLayer(set->model(), flags.Get("layer")));
  client::GatherOptions options;
  options.timeout = timeout;
  // A shard restarting (a rolling update) is waited out until --timeout-ms;
  // the worker library logs each retry, saying what the fetch waits for.
  ASSIGN_OR_RETURN(client::Layer layer, set->Gather(layer_index, options));
  if (flags.Has("verify-shards")) {
    // Bytes from a relay, checked against the shards' own digests of them.
    ASSIGN_OR_RETURN(std::vector<std::string> shards,
                     client::ParseShardList(flags.Get("verify-shards")));
    client::ShardSetOptions connect;
    ASSIGN_OR_RETURN(connect.credentials, ChannelCredentialsFromFlags(flags));
    connect.shards_name = "--verify-shards";
    ASSIGN_OR_RETURN(auto verify, client::ShardSet::Connect(std::move(shards), connect));
    RETURN_IF_ERROR(verify->CheckDigests(layer_index, layer.version(), std::nullopt,
                                         set->view().layouts[layer_index], layer.bytes()));
  }

  // An 8-bit tensor's block scales follow it as "<name>_scale", fp32 of
  // shape [blocks] (value = code * scale of its block, as in checkpoints
  // quantized with a weight_scale), the block size in the metadata.
  std::vector<SafetensorsWriter::TensorHeader> headers;
  std::vector<std::span<const uint8_t>> contents;
  for (size_t t = 0; t < layer.num_tensors(); ++t) {
    const client::Layer::TensorView view = layer.tensor(t);
    headers.push_back({std::string(view.name), view.dtype, {view.shape.begin(), view.shape.end()}});
    contents.push_back(view.bytes);
    if (view.block_size == 0) continue;
    headers.push_back({absl::StrCat(view.name, "_scale"),
                       DType::kFloat32,
                       {static_cast<int64_t>(view.scales.size())}});
    contents.emplace_back(reinterpret_cast<const uint8_t*>(view.scales.data()),
                          view.scales.size_bytes());
  }
  std::map<std::string, std::string> metadata = {
      {"model_id", set->model().model_id},
      {"layer", absl::StrCat(layer.index())},
      {"layer_name", layer.name()},
      {"version", absl::StrCat(layer.version())},
      {"policy", set->view().policy.ToString()},
  };
  if (headers.size() > layer.num_tensors()) {
    metadata["fp8_block_size"] = absl::StrCat(set->view().policy.fp8_block());
  }
  const std::string out = flags.Get("out");
  ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::Create(out, headers, metadata));
  uint64_t bytes = 0;
  for (const std::span<const uint8_t> content : contents) {
    RETURN_IF_ERROR(writer->Append(content));
    bytes += content.size();
  }
  RETURN_IF_ERROR(writer->Finish());
  std::printf("wrote layer %u (%s, %zu tensors, %s, version %llu) to %s\n", layer.index(),
              layer.name().c_str(), layer.num_tensors(), FormatBytes(bytes).c_str(),
              static_cast<unsigned long long>(layer.version()), out.c_str());
  return absl::OkStatus();
}

}  // namespace layercast::cli
