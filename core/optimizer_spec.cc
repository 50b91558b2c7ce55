#include "core/optimizer_spec.h"

#include <charconv>
#include <cmath>
#include <numbers>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "platform/glob.h"
#include "platform/status_macros.h"

namespace layercast {
namespace {

constexpr absl::string_view kSgdKeys =
    "lr, weight_decay, momentum, nesterov, dampening, warmup_steps, decay_steps, min_lr, clip";
constexpr absl::string_view kAdamWKeys =
    "lr, weight_decay, beta1, beta2, eps, warmup_steps, decay_steps, min_lr, clip";
constexpr absl::string_view kSgdOverrideKeys = "lr, weight_decay, momentum, nesterov";
constexpr absl::string_view kAdamWOverrideKeys = "lr, weight_decay, beta1, beta2, eps";
constexpr absl::string_view kExample =
    "e.g. 'adamw:lr=3e-4,weight_decay=0.1;*norm*:weight_decay=0' or "
    "'sgd:lr=0.1,momentum=0.9,nesterov=1'";

absl::Status SpecError(absl::string_view text, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("optimizer spec '", text, "': ", problem));
}

// Shortest text that reads back as the same double.
std::string FormatNumber(double value) {
  char buffer[32];
  auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, end);
}

// One part's key=value pairs, split and checked for shape and repeats.
absl::StatusOr<std::vector<std::pair<absl::string_view, absl::string_view>>> SplitPairs(
    absl::string_view text, absl::string_view pairs) {
  std::vector<std::pair<absl::string_view, absl::string_view>> out;
  std::set<absl::string_view> seen;
  for (absl::string_view part : absl::StrSplit(pairs, ',')) {
    std::vector<absl::string_view> pieces = absl::StrSplit(part, '=');
    if (pieces.size() != 2 || pieces[0].empty() || pieces[1].empty()) {
      return SpecError(text, absl::StrCat("'", part,
                                          "' is not a key=value pair: write pairs separated by "
                                          "',' without spaces, ",
                                          kExample));
    }
    if (!seen.insert(pieces[0]).second) {
      return SpecError(text, absl::StrCat("key '", pieces[0], "' is given twice in '", pairs,
                                          "': give each key once"));
    }
    out.emplace_back(pieces[0], pieces[1]);
  }
  return out;
}

absl::StatusOr<double> ParseNumber(absl::string_view text, absl::string_view key,
                                   absl::string_view value) {
  double number = 0;
  auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), number);
  if (error != std::errc() || end != value.data() + value.size() || !std::isfinite(number)) {
    return SpecError(text, absl::StrCat(key, "=", value, ": '", value,
                                        "' is not a finite number such as 0.1 or 3e-4"));
  }
  return number;
}

absl::StatusOr<double> ParseAtLeastZero(absl::string_view text, absl::string_view key,
                                        absl::string_view value) {
  ASSIGN_OR_RETURN(double number, ParseNumber(text, key, value));
  if (number < 0 || std::signbit(number)) {
    return SpecError(text, absl::StrCat(key, "=", value, ": ", key, " must be >= 0"));
  }
  return number;
}

absl::StatusOr<double> ParseBeta(absl::string_view text, absl::string_view key,
                                 absl::string_view value) {
  ASSIGN_OR_RETURN(double number, ParseNumber(text, key, value));
  if (!(number >= 0 && number < 1) || std::signbit(number)) {
    return SpecError(text, absl::StrCat(key, "=", value, ": ", key, " must be in [0, 1)"));
  }
  return number;
}

absl::StatusOr<uint64_t> ParseCount(absl::string_view text, absl::string_view key,
                                    absl::string_view value) {
  uint64_t count = 0;
  auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), count);
  if (error != std::errc() || end != value.data() + value.size()) {
    return SpecError(text, absl::StrCat(key, "=", value, ": '", value,
                                        "' is not a whole number of steps such as 100"));
  }
  return count;
}

absl::StatusOr<bool> ParseBool(absl::string_view text, absl::string_view key,
                               absl::string_view value) {
  if (value == "1" || value == "true") return true;
  if (value == "0" || value == "false") return false;
  return SpecError(text, absl::StrCat(key, "=", value, ": use 1, 0, true or false"));
}

// Sets one per-tensor key of `keys`; false when `key` is not a per-tensor
// key of `kind`. The first part's keys go through an Override too, so both
// parts accept exactly the same per-tensor keys and values.
absl::StatusOr<bool> SetPerTensorKey(absl::string_view text, OptimizerKind kind,
                                     absl::string_view key, absl::string_view value,
                                     OptimizerSpec::Override& keys) {
  const bool sgd = kind == OptimizerKind::kSgd;
  if (key == "lr") {
    ASSIGN_OR_RETURN(keys.lr, ParseAtLeastZero(text, key, value));
  } else if (key == "weight_decay") {
    ASSIGN_OR_RETURN(keys.weight_decay, ParseAtLeastZero(text, key, value));
  } else if (sgd && key == "momentum") {
    ASSIGN_OR_RETURN(keys.momentum, ParseAtLeastZero(text, key, value));
  } else if (sgd && key == "nesterov") {
    ASSIGN_OR_RETURN(keys.nesterov, ParseBool(text, key, value));
  } else if (!sgd && key == "beta1") {
    ASSIGN_OR_RETURN(keys.beta1, ParseBeta(text, key, value));
  } else if (!sgd && key == "beta2") {
    ASSIGN_OR_RETURN(keys.beta2, ParseBeta(text, key, value));
  } else if (!sgd && key == "eps") {
    ASSIGN_OR_RETURN(keys.eps, ParseAtLeastZero(text, key, value));
  } else {
    return false;
  }
  return true;
}

OptimizerHyper Apply(const OptimizerHyper& base, const OptimizerSpec::Override& override) {
  OptimizerHyper hyper = base;
  hyper.lr = override.lr.value_or(hyper.lr);
  hyper.weight_decay = override.weight_decay.value_or(hyper.weight_decay);
  hyper.momentum = override.momentum.value_or(hyper.momentum);
  hyper.nesterov = override.nesterov.value_or(hyper.nesterov);
  hyper.beta1 = override.beta1.value_or(hyper.beta1);
  hyper.beta2 = override.beta2.value_or(hyper.beta2);
  hyper.eps = override.eps.value_or(hyper.eps);
  return hyper;
}

// torch.optim.SGD's rule, checked on what a tensor would actually get.
absl::Status CheckNesterov(absl::string_view text, const OptimizerHyper& hyper,
                           absl::string_view where) {
  if (hyper.nesterov && hyper.momentum <= 0) {
    return SpecError(text, absl::StrCat("nesterov=1 needs momentum > 0 (as in torch.optim.SGD), ",
                                        where, " has momentum ", FormatNumber(hyper.momentum)));
  }
  return absl::OkStatus();
}

void AppendPerTensorKeys(const OptimizerSpec::Override& keys, std::vector<std::string>& out) {
  auto add = [&out](absl::string_view key, const std::optional<double>& value) {
    if (value) out.push_back(absl::StrCat(key, "=", FormatNumber(*value)));
  };
  add("lr", keys.lr);
  add("weight_decay", keys.weight_decay);
  add("momentum", keys.momentum);
  if (keys.nesterov) out.push_back(absl::StrCat("nesterov=", *keys.nesterov ? "1" : "0"));
  add("beta1", keys.beta1);
  add("beta2", keys.beta2);
  add("eps", keys.eps);
}

}  // namespace

absl::string_view OptimizerKindName(OptimizerKind kind) {
  return kind == OptimizerKind::kSgd ? "sgd" : "adamw";
}

absl::StatusOr<OptimizerSpec> OptimizerSpec::Parse(absl::string_view text) {
  std::vector<absl::string_view> sections = absl::StrSplit(text, ';');
  const size_t colon = sections[0].find(':');
  if (colon == absl::string_view::npos) {
    return SpecError(
        text, absl::StrCat("'", sections[0],
                           "' lacks the ':' after the optimizer kind (sgd or adamw), ", kExample));
  }
  const absl::string_view kind_name = sections[0].substr(0, colon);
  OptimizerSpec spec;
  if (kind_name == "sgd") {
    spec.kind_ = OptimizerKind::kSgd;
    spec.defaults_.weight_decay = 0;
  } else if (kind_name == "adamw") {
    spec.kind_ = OptimizerKind::kAdamW;
    spec.defaults_.weight_decay = 1e-2;
  } else {
    return SpecError(text,
                     absl::StrCat("unknown optimizer kind '", kind_name, "': use sgd or adamw"));
  }
  const bool sgd = spec.kind_ == OptimizerKind::kSgd;

  ASSIGN_OR_RETURN(auto pairs, SplitPairs(text, sections[0].substr(colon + 1)));
  Override base;
  std::optional<double> min_lr;
  for (auto [key, value] : pairs) {
    ASSIGN_OR_RETURN(const bool per_tensor, SetPerTensorKey(text, spec.kind_, key, value, base));
    if (per_tensor) continue;
    if (key == "warmup_steps") {
      ASSIGN_OR_RETURN(spec.warmup_steps_, ParseCount(text, key, value));
    } else if (key == "decay_steps") {
      ASSIGN_OR_RETURN(spec.decay_steps_, ParseCount(text, key, value));
    } else if (key == "min_lr") {
      ASSIGN_OR_RETURN(min_lr, ParseAtLeastZero(text, key, value));
    } else if (key == "clip") {
      ASSIGN_OR_RETURN(double clip, ParseNumber(text, key, value));
      if (clip <= 0) {
        return SpecError(text, absl::StrCat("clip=", value,
                                            ": the max gradient norm must be > 0 (leave clip out "
                                            "to not clip)"));
      }
      spec.clip_ = clip;
    } else if (sgd && key == "dampening") {
      ASSIGN_OR_RETURN(double dampening, ParseNumber(text, key, value));
      if (dampening != 0) {
        return SpecError(text, absl::StrCat("dampening=", value,
                                            ": only dampening=0 (torch's default) is supported"));
      }
    } else {
      const bool other_kind = sgd ? (key == "beta1" || key == "beta2" || key == "eps")
                                  : (key == "momentum" || key == "nesterov" || key == "dampening");
      return SpecError(
          text, absl::StrCat(other_kind ? "key '" : "unknown key '", key, "'",
                             other_kind ? absl::StrCat(" is not valid for ", kind_name) : "", ": ",
                             kind_name, " takes ", sgd ? kSgdKeys : kAdamWKeys));
    }
  }
  if (!base.lr) {
    return SpecError(
        text, absl::StrCat("lr is required, e.g. '", kind_name, ":lr=", sgd ? "0.1" : "3e-4", "'"));
  }
  spec.defaults_ = Apply(spec.defaults_, base);
  RETURN_IF_ERROR(CheckNesterov(text, spec.defaults_, "but the first part"));
  if (min_lr) {
    if (spec.decay_steps_ == 0) {
      return SpecError(text, "min_lr is the end of the cosine decay: give decay_steps > 0 too");
    }
    if (*min_lr > spec.defaults_.lr) {
      return SpecError(
          text, absl::StrCat("min_lr ", FormatNumber(*min_lr), " exceeds lr ",
                             FormatNumber(spec.defaults_.lr), ": the lr decays down to min_lr"));
    }
    spec.min_lr_ = *min_lr;
  }

  for (size_t i = 1; i < sections.size(); ++i) {
    const absl::string_view section = sections[i];
    const size_t split = section.rfind(':');
    if (split == absl::string_view::npos || split == 0 || split + 1 == section.size()) {
      return SpecError(text, absl::StrCat("override '", section,
                                          "' is not glob:key=value[,key=value...], e.g. "
                                          "'*norm*:weight_decay=0'"));
    }
    Override override;
    override.glob = std::string(section.substr(0, split));
    ASSIGN_OR_RETURN(auto override_pairs, SplitPairs(text, section.substr(split + 1)));
    for (auto [key, value] : override_pairs) {
      ASSIGN_OR_RETURN(const bool per_tensor,
                       SetPerTensorKey(text, spec.kind_, key, value, override));
      if (per_tensor) continue;
      return SpecError(
          text,
          absl::StrCat("override '", section, "': key '", key, "' cannot be set per tensor; ",
                       kind_name, " overrides take ", sgd ? kSgdOverrideKeys : kAdamWOverrideKeys));
    }
    RETURN_IF_ERROR(CheckNesterov(text, Apply(spec.defaults_, override),
                                  absl::StrCat("but a tensor matching '", override.glob, "'")));
    spec.overrides_.push_back(std::move(override));
  }
  return spec;
}

OptimizerHyper OptimizerSpec::HyperFor(absl::string_view tensor_name) const {
  for (const Override& override : overrides_) {
    if (GlobMatches(override.glob, tensor_name)) return Apply(defaults_, override);
  }
  return defaults_;
}

double OptimizerSpec::LearningRate(const OptimizerHyper& hyper, uint64_t step) const {
  if (step == 0) return 0;
  if (step <= warmup_steps_) {
    return hyper.lr * static_cast<double>(step) / static_cast<double>(warmup_steps_);
  }
  if (decay_steps_ == 0) return hyper.lr;
  const double floor = defaults_.lr > 0 ? min_lr_ / defaults_.lr : 0;
  const uint64_t decayed = step - warmup_steps_;
  if (decayed >= decay_steps_) return hyper.lr * floor;
  const double cosine = (1 + std::cos(std::numbers::pi * static_cast<double>(decayed) /
                                      static_cast<double>(decay_steps_))) /
                        2;
  return hyper.lr * (floor + (1 - floor) * cosine);
}

std::string OptimizerSpec::ToString() const {
  Override base;
  base.lr = defaults_.lr;
  base.weight_decay = defaults_.weight_decay;
  if (kind_ == OptimizerKind::kSgd) {
    base.momentum = defaults_.momentum;
    base.nesterov = defaults_.nesterov;
  } else {
    base.beta1 = defaults_.beta1;
    base.beta2 = defaults_.beta2;
    base.eps = defaults_.eps;
  }
  std::vector<std::string> pairs;
  AppendPerTensorKeys(base, pairs);
  if (warmup_steps_ != 0) pairs.push_back(absl::StrCat("warmup_steps=", warmup_steps_));
  if (decay_steps_ != 0) {
    pairs.push_back(absl::StrCat("decay_steps=", decay_steps_));
    pairs.push_back(absl::StrCat("min_lr=", FormatNumber(min_lr_)));
  }
  if (clip_) pairs.push_back(absl::StrCat("clip=", FormatNumber(*clip_)));
  std::string out = absl::StrCat(OptimizerKindName(kind_), ":", absl::StrJoin(pairs, ","));
  for (const Override& override : overrides_) {
    std::vector<std::string> keys;
    AppendPerTensorKeys(override, keys);
    absl::StrAppend(&out, ";", override.glob, ":", absl::StrJoin(keys, ","));
  }
  return out;
}

}  // namespace layercast
