#include "core/policy.h"

#include <algorithm>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "platform/glob.h"
#include "platform/status_macros.h"

namespace layercast {
namespace {

constexpr absl::string_view kAcceptedDTypes =
    "float32 (f32, full), bfloat16 (bf16), float16 (f16), and for compute and overrides only "
    "float8_e4m3fn (f8e4m3) or float8_e5m2 (f8e5m2)";
constexpr absl::string_view kAcceptedKeys =
    "params (p), compute (c), output (o), overflow, max_rel_error or fp8_block";
constexpr absl::string_view kKeyValueExpected =
    "a key=value pair: write pairs separated by ',' without spaces, e.g. "
    "'params=float32,compute=bfloat16,output=float32'";
constexpr absl::string_view kOverrideExpected =
    "an override glob=dtype, e.g. 'p=f32,c=bf16;*norm*=f32;lm_head.*=f32'";

absl::Status PolicyError(absl::string_view text, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("precision policy '", text, "': ", problem));
}

// jmp's names, matched exactly as jmp does (case-sensitive, no trimming).
absl::StatusOr<DType> ParseDType(absl::string_view policy_text, absl::string_view value) {
  if (absl::StatusOr<DType> dtype = DTypeFromName(value); dtype.ok()) return dtype;
  if (value == "full") return DType::kFloat32;
  if (value == "half") {
    return PolicyError(policy_text,
                       "dtype 'half' is refused: jmp resolves it to bfloat16 on TPU and float16 "
                       "elsewhere, so it would mean different things on different machines; "
                       "write bfloat16 or float16");
  }
  if (value == "float64" || value == "f64") {
    return PolicyError(policy_text, absl::StrCat("dtype '", value,
                                                 "' is refused: layercast keeps float32 masters "
                                                 "and computes in ",
                                                 kAcceptedDTypes));
  }
  return PolicyError(policy_text,
                     absl::StrCat("unknown dtype '", value, "': use ", kAcceptedDTypes));
}

absl::StatusOr<Fp16Overflow> ParseOverflow(absl::string_view policy_text, absl::string_view value) {
  if (value == "error") return Fp16Overflow::kError;
  if (value == "saturate") return Fp16Overflow::kSaturate;
  if (value == "inf") return Fp16Overflow::kInfinity;
  return PolicyError(
      policy_text, absl::StrCat("unknown overflow rule '", value, "': use error, saturate or inf"));
}

// A bound on a relative error: above 0 (no cast that narrows is exact for
// every value) and at most 1 (a value flushed to zero loses 1).
absl::StatusOr<float> ParseMaxRelError(absl::string_view policy_text, absl::string_view value) {
  // Checked as the float it is kept as: 1e-50 is above 0 only as a double.
  double parsed;
  const float bound = absl::SimpleAtod(value, &parsed) ? static_cast<float>(parsed) : 0.0f;
  if (!(bound > 0 && bound <= 1)) {
    return PolicyError(policy_text,
                       absl::StrCat("max_rel_error '", value,
                                    "' is not a number above 0 and at most 1, e.g. 0.01: the "
                                    "largest relative error |cast - x| / |x| a layer may carry"));
  }
  return bound;
}

absl::StatusOr<uint32_t> ParseFp8Block(absl::string_view policy_text, absl::string_view value) {
  uint64_t block = 0;
  if (!absl::SimpleAtoi(value, &block) || !IsValidFp8Block(block)) {
    return PolicyError(
        policy_text,
        absl::StrCat("fp8_block '", value, "' is not a power of two from ", kMinFp8Block, " to ",
                     kMaxFp8Block, ": the elements that share one fp8 scale, e.g. 128"));
  }
  return static_cast<uint32_t>(block);
}

// The 8-bit floats hold what a layer computes with, sent with their scales;
// a master or an output in 8 bits would lose what the master is kept for.
absl::Status CheckNotFloat8(absl::string_view policy_text, absl::string_view key, DType dtype) {
  if (!IsFloat8(dtype)) return absl::OkStatus();
  return PolicyError(policy_text, absl::StrCat(key, "=", DTypeName(dtype),
                                               " is refused: 8-bit floats are compute dtypes "
                                               "only; write compute=",
                                               DTypeName(dtype), " (or an override) and keep ", key,
                                               " float32, bfloat16 or float16"));
}

// The fewest digits that parse back to `value` ("0.01", not 0.00999999978);
// nine always do.
std::string ShortestFloat(float value) {
  for (int digits = 1; digits < 9; ++digits) {
    std::string text = absl::StrFormat("%.*g", digits, value);
    double back;
    if (absl::SimpleAtod(text, &back) && static_cast<float>(back) == value) return text;
  }
  return absl::StrFormat("%.9g", value);
}

absl::string_view OverflowName(Fp16Overflow overflow) {
  switch (overflow) {
    case Fp16Overflow::kError:
      return "error";
    case Fp16Overflow::kSaturate:
      return "saturate";
    case Fp16Overflow::kInfinity:
      return "inf";
  }
  return "error";
}

// Splits "key=value" where jmp would have unpacked `part.split("=", 2)` into
// two names; jmp raises a bare unpacking error there, we say what is wrong.
absl::StatusOr<std::pair<absl::string_view, absl::string_view>> SplitAssignment(
    absl::string_view text, absl::string_view part, absl::string_view expected) {
  std::vector<absl::string_view> pieces = absl::StrSplit(part, '=');
  if (pieces.size() != 2 || pieces[0].empty() || pieces[1].empty()) {
    return PolicyError(text, absl::StrCat("'", part, "' is not ", expected));
  }
  return std::make_pair(pieces[0], pieces[1]);
}

}  // namespace

absl::StatusOr<Policy> Policy::Parse(absl::string_view text) {
  std::vector<absl::string_view> sections = absl::StrSplit(text, ';');
  const absl::string_view base = sections[0];
  if (base.empty()) {
    return PolicyError(text, absl::StrCat("empty; write a dtype such as 'bfloat16' or keys "
                                          "such as 'params=float32,compute=bfloat16', keys ",
                                          kAcceptedKeys));
  }

  Policy policy;
  if (base.find('=') == absl::string_view::npos) {
    ASSIGN_OR_RETURN(DType all, ParseDType(text, base));
    RETURN_IF_ERROR(CheckNotFloat8(text, "params", all));
    policy.params_ = policy.compute_ = policy.output_ = all;
  } else {
    std::optional<DType> compute, output;
    for (absl::string_view part : absl::StrSplit(base, ',')) {
      ASSIGN_OR_RETURN(auto assignment, SplitAssignment(text, part, kKeyValueExpected));
      auto [key, value] = assignment;
      if (key == "overflow") {
        ASSIGN_OR_RETURN(policy.overflow_, ParseOverflow(text, value));
        continue;
      }
      if (key == "max_rel_error") {
        ASSIGN_OR_RETURN(policy.max_rel_error_, ParseMaxRelError(text, value));
        continue;
      }
      if (key == "fp8_block") {
        ASSIGN_OR_RETURN(policy.fp8_block_, ParseFp8Block(text, value));
        continue;
      }
      ASSIGN_OR_RETURN(DType dtype, ParseDType(text, value));
      if (key == "p" || key == "params") {
        RETURN_IF_ERROR(CheckNotFloat8(text, "params", dtype));
        policy.params_ = dtype;
      } else if (key == "c" || key == "compute") {
        compute = dtype;
      } else if (key == "o" || key == "output") {
        RETURN_IF_ERROR(CheckNotFloat8(text, "output", dtype));
        output = dtype;
      } else {
        return PolicyError(text, absl::StrCat("unknown key '", key, "': use ", kAcceptedKeys));
      }
    }
    policy.compute_ = compute.value_or(policy.params_);
    // jmp's default output is compute; an 8-bit compute leaves it at params.
    policy.output_ = output.value_or(IsFloat8(policy.compute_) ? policy.params_ : policy.compute_);
  }

  for (size_t i = 1; i < sections.size(); ++i) {
    ASSIGN_OR_RETURN(auto assignment, SplitAssignment(text, sections[i], kOverrideExpected));
    auto [glob, value] = assignment;
    ASSIGN_OR_RETURN(DType dtype, ParseDType(text, value));
    policy.overrides_.push_back(Override{std::string(glob), dtype});
  }
  return policy;
}

bool IsValidFp8Block(uint64_t block) {
  return block >= kMinFp8Block && block <= kMaxFp8Block && (block & (block - 1)) == 0;
}

DType Policy::ComputeDTypeFor(absl::string_view tensor_name) const {
  for (const Override& override : overrides_) {
    if (GlobMatches(override.glob, tensor_name)) return override.compute;
  }
  return compute_;
}

bool Policy::UsesFloat8() const {
  return IsFloat8(compute_) || std::any_of(overrides_.begin(), overrides_.end(),
                                           [](const Override& o) { return IsFloat8(o.compute); });
}

std::string Policy::ToString() const {
  std::string out = absl::StrCat("params=", DTypeName(params_), ",compute=", DTypeName(compute_),
                                 ",output=", DTypeName(output_));
  if (overflow_ != Fp16Overflow::kError)
    absl::StrAppend(&out, ",overflow=", OverflowName(overflow_));
  if (max_rel_error_) absl::StrAppend(&out, ",max_rel_error=", ShortestFloat(*max_rel_error_));
  if (UsesFloat8() || fp8_block_ != kDefaultFp8Block)
    absl::StrAppend(&out, ",fp8_block=", fp8_block_);
  for (const Override& override : overrides_) {
    absl::StrAppend(&out, ";", override.glob, "=", DTypeName(override.compute));
  }
  return out;
}

}  // namespace layercast
