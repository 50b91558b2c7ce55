#include "core/dtype.h"

#include "absl/strings/str_cat.h"

namespace layercast {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
      return 1;
  }
  return 4;
}

bool IsFloat8(DType dtype) { return dtype == DType::kFloat8E4M3FN || dtype == DType::kFloat8E5M2; }

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat8E4M3FN:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

absl::string_view DTypeShortName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "f32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "f16";
    case DType::kFloat8E4M3FN:
      return "f8e4m3";
    case DType::kFloat8E5M2:
      return "f8e5m2";
  }
  return "unknown";
}

absl::StatusOr<DType> DTypeFromName(absl::string_view name) {
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                            DType::kFloat8E4M3FN, DType::kFloat8E5M2}) {
    if (name == DTypeName(dtype) || name == DTypeShortName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name,
                   "': use float32, bfloat16, float16, float8_e4m3fn or float8_e5m2 (or f32, "
                   "bf16, f16, f8e4m3, f8e5m2)"));
}

absl::string_view DTypeSafetensorsName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "F32";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat16:
      return "F16";
    case DType::kFloat8E4M3FN:
      return "F8_E4M3";
    case DType::kFloat8E5M2:
      return "F8_E5M2";
  }
  return "unknown";
}

absl::StatusOr<DType> DTypeFromSafetensorsName(absl::string_view name) {
  if (name == "F32") return DType::kFloat32;
  if (name == "BF16") return DType::kBFloat16;
  if (name == "F16") return DType::kFloat16;
  return absl::InvalidArgumentError(absl::StrCat(
      "safetensors dtype '", name, "' is not supported: layercast accepts F32, BF16 and F16"));
}

}  // namespace layercast
