#pragma once

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace layercast {

// Element types layercast stores and sends. The numeric values equal the wire
// enum `layercast.v1.DType`, so conversion is a static_cast.
enum class DType : uint8_t {
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
};

// Bytes per element: 4 for kFloat32, 2 for the 16-bit types.
size_t DTypeSize(DType dtype);

// Canonical long name as the policy grammar writes it: "float32", "bfloat16",
// "float16".
absl::string_view DTypeName(DType dtype);

// Short name as the policy grammar writes it: "f32", "bf16", "f16".
absl::string_view DTypeShortName(DType dtype);

// The safetensors dtype tag: "F32", "BF16", "F16".
absl::string_view DTypeSafetensorsName(DType dtype);

// Parses a safetensors dtype tag. Other tags (F64, I8, ...) are refused with
// INVALID_ARGUMENT naming the tag and what is accepted.
absl::StatusOr<DType> DTypeFromSafetensorsName(absl::string_view name);

}  // namespace layercast
