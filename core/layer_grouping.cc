#include "core/layer_grouping.h"

#include <algorithm>
#include <charconv>
#include <map>
// GCC 12 reports a false -Wmaybe-uninitialized inside libstdc++'s regex
// compiler when built with sanitizers (GCC bug 105562).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <regex>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace layercast {
namespace {

absl::Status Invalid(const std::string& model_id, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat("grouping model '", model_id, "': ", problem));
}

// The manifest is built from these specs, so a count that disagrees with the
// shape would make client and server size buffers differently.
absl::Status CheckShape(const std::string& model_id, const TensorSpec& tensor) {
  uint64_t elements = 1;
  for (int64_t dim : tensor.shape) {
    if (dim < 0) {
      return Invalid(model_id,
                     absl::StrCat("tensor '", tensor.name, "' has negative dimension ", dim));
    }
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(dim), &elements)) {
      return Invalid(model_id, absl::StrCat("tensor '", tensor.name,
                                            "' has more elements than fit in 64 bits"));
    }
  }
  if (elements != tensor.num_elements) {
    return Invalid(model_id, absl::StrCat("tensor '", tensor.name, "' has num_elements ",
                                          tensor.num_elements, " but its shape holds ", elements));
  }
  return absl::OkStatus();
}

std::string WithoutTrailingDot(std::string name) {
  if (!name.empty() && name.back() == '.') name.pop_back();
  return name;
}

}  // namespace

absl::StatusOr<ModelSpec> GroupIntoLayers(std::string model_id, std::vector<TensorSpec> tensors,
                                          const LayerGroupingRule& rule) {
  if (tensors.empty()) return Invalid(model_id, "there are no tensors");
  // std::regex reports a bad pattern only by exception; it stops here.
  std::regex layer_regex;
  try {
    layer_regex = std::regex(rule.layer_regex, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return Invalid(model_id, absl::StrCat("layer_regex '", rule.layer_regex,
                                          "' does not compile: ", e.what()));
  }
  if (layer_regex.mark_count() != 1) {
    return Invalid(
        model_id,
        absl::StrCat("layer_regex '", rule.layer_regex, "' has ", layer_regex.mark_count(),
                     " capture groups; it needs exactly one, the layer index"));
  }

  // Sorting first makes every group come out sorted by name.
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorSpec& a, const TensorSpec& b) { return a.name < b.name; });
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name.empty()) return Invalid(model_id, "a tensor has an empty name");
    if (i > 0 && tensors[i].name == tensors[i - 1].name) {
      return Invalid(model_id, absl::StrCat("tensor '", tensors[i].name, "' appears twice"));
    }
    if (absl::Status status = CheckShape(model_id, tensors[i]); !status.ok()) return status;
  }

  LayerSpec first{WithoutTrailingDot(rule.first_prefix), {}};
  LayerSpec last{rule.last_name, {}};
  std::map<uint64_t, LayerSpec> numbered;
  for (TensorSpec& tensor : tensors) {
    if (!rule.first_prefix.empty() && tensor.name.starts_with(rule.first_prefix)) {
      first.tensors.push_back(std::move(tensor));
      continue;
    }
    std::smatch match;
    bool matched = false;
    try {
      matched = std::regex_search(tensor.name, match, layer_regex);
    } catch (const std::regex_error& e) {  // e.g. error_complexity on a pathological pattern
      return Invalid(model_id, absl::StrCat("layer_regex '", rule.layer_regex,
                                            "' failed on tensor '", tensor.name, "': ", e.what()));
    }
    // A match whose optional group took no part ('^(?:blocks\.(\d+)\.)?')
    // names no layer index: the tensor is one of the rest.
    if (!matched || !match[1].matched) {
      last.tensors.push_back(std::move(tensor));
      continue;
    }
    const std::string capture = match[1].str();
    uint64_t index = 0;
    const auto [end, error] =
        std::from_chars(capture.data(), capture.data() + capture.size(), index);
    if (capture.empty() || error != std::errc() || end != capture.data() + capture.size()) {
      return Invalid(model_id,
                     absl::StrCat("layer_regex '", rule.layer_regex, "' captured '", capture,
                                  "' from tensor '", tensor.name, "', not a decimal layer index"));
    }
    std::string name = WithoutTrailingDot(match.str(0));
    auto [it, inserted] = numbered.try_emplace(index, LayerSpec{name, {}});
    if (!inserted && it->second.name != name) {
      return Invalid(model_id, absl::StrCat("layer index ", index, " is spelled both '",
                                            it->second.name, "' and '", name, "'"));
    }
    it->second.tensors.push_back(std::move(tensor));
  }

  ModelSpec model;
  model.model_id = std::move(model_id);
  if (!first.tensors.empty()) model.layers.push_back(std::move(first));
  for (auto& [index, layer] : numbered) model.layers.push_back(std::move(layer));
  if (!last.tensors.empty()) model.layers.push_back(std::move(last));
  // Layers are addressed by name, so two with one name would be ambiguous.
  std::set<std::string> names;
  for (const LayerSpec& layer : model.layers) {
    if (layer.name.empty()) return Invalid(model.model_id, "a layer name is empty");
    if (!names.insert(layer.name).second) {
      return Invalid(model.model_id, absl::StrCat("two layers are both named '", layer.name, "'"));
    }
  }
  return model;
}

absl::StatusOr<ModelSpec> ModelSpecFromSafetensors(const SafetensorsReader& reader,
                                                   std::string model_id,
                                                   const LayerGroupingRule& rule) {
  std::vector<TensorSpec> tensors;
  tensors.reserve(reader.tensors().size());
  for (const SafetensorsTensor& tensor : reader.tensors()) {
    tensors.push_back(TensorSpec{tensor.name, tensor.shape, tensor.num_elements});
  }
  return GroupIntoLayers(std::move(model_id), std::move(tensors), rule);
}

}  // namespace layercast
