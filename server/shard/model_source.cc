#include "server/shard/model_source.h"

#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/safetensors_source.h"
#include "core/synthetic_model.h"
#include "platform/glob.h"
#include "platform/log.h"
#include "platform/status_macros.h"

namespace layercast::server {

absl::StatusOr<std::unique_ptr<ParameterSource>> OpenSource(const ShardSettings& settings) {
  const auto& config = settings.config;
  if (!config.synthetic().empty()) {
    ASSIGN_OR_RETURN(auto synthetic, SyntheticModel::Create(config.synthetic()));
    return std::unique_ptr<ParameterSource>(std::move(synthetic));
  }
  // A Hugging Face folder, as transformers and vLLM take it: its index if
  // it has one, else its single file; the model id is the folder's name.
  std::string path = config.model();
  std::string model_id = config.model_id();
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    const std::filesystem::path dir(path);
    std::string found;
    for (const char* name : {"model.safetensors.index.json", "model.safetensors"}) {
      if (std::filesystem::exists(dir / name, error)) {
        found = (dir / name).string();
        break;
      }
    }
    if (found.empty()) {
      return absl::NotFoundError(
          absl::StrCat("--model ", path,
                       " is a folder with neither model.safetensors.index.json nor "
                       "model.safetensors in it: name the .safetensors file or the index"));
    }
    if (model_id.empty())
      model_id = std::filesystem::absolute(dir).lexically_normal().filename().string();
    if (model_id.empty())
      model_id = std::filesystem::absolute(dir).parent_path().filename().string();
    Log()->info("--model {}: serving {} as model '{}'", path, found, model_id);
    path = found;
  } else if (model_id.empty()) {
    // A file's stem ("llama-7b" of llama-7b.safetensors), or for a file
    // named as Hugging Face names them, its folder's name.
    const std::filesystem::path file = std::filesystem::absolute(path).lexically_normal();
    std::string name = file.filename().string();
    if (name == "model.safetensors" || name == "model.safetensors.index.json") {
      model_id = file.parent_path().filename().string();
    } else {
      for (const char* suffix : {".safetensors.index.json", ".safetensors"}) {
        if (absl::EndsWith(name, suffix) && name.size() > std::strlen(suffix)) {
          name.resize(name.size() - std::strlen(suffix));
          break;
        }
      }
      model_id = name;
    }
  }
  ASSIGN_OR_RETURN(auto file, SafetensorsSource::Open(path, model_id, settings.grouping));
  const ModelSpec& model = file->model();
  for (const auto& [dtype, elements] : file->StoredElements()) {
    if (dtype == DType::kFloat32) continue;
    Log()->info(
        "{} elements of {} are stored as {}: widened exactly to the fp32 master, which "
        "holds them in {}x their bytes in the file",
        elements, model.model_id, DTypeSafetensorsName(dtype), 4 / DTypeSize(dtype));
  }
  for (const SafetensorsSkipped& skipped : file->Skipped()) {
    Log()->warn(
        "skipping tensor '{}' of {}: its dtype {} is not a floating-point parameter layercast "
        "serves (F32, BF16, F16); workers that need it read it from the model file "
        "(docs/models.md)",
        skipped.name, model.model_id, skipped.dtype);
  }
  if (model.layers.size() == 1 && model.layers[0].name == settings.grouping.last_name &&
      model.layers[0].tensors.size() > 1) {
    Log()->warn(
        "no tensor name of {} matched the layer rules (first prefix '{}', --layer-regex '{}'): "
        "the whole model is one layer '{}', gathered at once. Set --layer-regex for its naming, "
        "e.g. '^transformer\\.h\\.(\\d+)\\.' for GPT-2, and --first-layer-prefix for its "
        "embedding, e.g. 'transformer.wte.' (docs/models.md)",
        model.model_id, settings.grouping.first_prefix, settings.grouping.layer_regex,
        settings.grouping.last_name);
  }
  return std::unique_ptr<ParameterSource>(std::move(file));
}

// A per-tensor rule that matches no tensor of the model is most often a typo
// in its glob: said at start-up, naming the rule and a real tensor name.
void WarnUnmatchedRules(const ModelSpec& model, const Policy& policy,
                        const std::optional<OptimizerSpec>& optimizer) {
  const auto matches_any = [&](const std::string& glob) {
    for (const LayerSpec& layer : model.layers) {
      for (const TensorSpec& tensor : layer.tensors) {
        if (GlobMatches(glob, tensor.name)) return true;
      }
    }
    return false;
  };
  std::string example;
  if (!model.layers.empty() && !model.layers.back().tensors.empty()) {
    example = model.layers.back().tensors.front().name;
  }
  for (const Policy::Override& rule : policy.overrides()) {
    if (!matches_any(rule.glob)) {
      Log()->warn(
          "--policy override '{}={}' matches no tensor of {}: check its glob (tensor "
          "names look like '{}')",
          rule.glob, DTypeName(rule.compute), model.model_id, example);
    }
  }
  if (!optimizer) return;
  for (const OptimizerSpec::Override& rule : optimizer->overrides()) {
    if (!matches_any(rule.glob)) {
      Log()->warn(
          "--optimizer override '{}' matches no tensor of {}: check its glob (tensor "
          "names look like '{}')",
          rule.glob, model.model_id, example);
    }
  }
}

}  // namespace layercast::server
