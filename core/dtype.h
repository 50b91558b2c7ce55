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
  // OCP 8-bit floats (core/fp8.h), a compute dtype only: each tensor is sent
  // as codes plus one fp32 scale per block of elements (the policy's
  // fp8_block), and the pair is what a worker receives.
  kFloat8E4M3FN = 4,
  kFloat8E5M2 = 5,
};

// Bytes per element: 4 for kFloat32, 2 for the 16-bit types, 1 for the
// 8-bit ones (their block scales come on top).
size_t DTypeSize(DType dtype);

// Whether `dtype` is one of the 8-bit floats, which carry block scales.
bool IsFloat8(DType dtype);

// Canonical long name as the policy grammar writes it: "float32", "bfloat16",
// "float16", "float8_e4m3fn", "float8_e5m2".
absl::string_view DTypeName(DType dtype);

// Short name as the policy grammar writes it: "f32", "bf16", "f16", "f8e4m3",
// "f8e5m2".
absl::string_view DTypeShortName(DType dtype);

// Parses a long or short name ("float32" or "f32", ...). INVALID_ARGUMENT
// naming the accepted ones for anything else.
absl::StatusOr<DType> DTypeFromName(absl::string_view name);

// The safetensors dtype tag: "F32", "BF16", "F16", "F8_E4M3", "F8_E5M2".
absl::string_view DTypeSafetensorsName(DType dtype);

// Parses a safetensors dtype tag. Other tags (F64, I8, ...) are refused with
// INVALID_ARGUMENT naming the tag and what is accepted.
absl::StatusOr<DType> DTypeFromSafetensorsName(absl::string_view name);

}  // namespace layercast
