// One table for the integer and boolean tags, which the reader skips and the
// writer writes: their names and sizes are never spelled twice.

#include "core/safetensors_dtype.h"

#include <array>

#include "absl/strings/str_cat.h"

namespace layercast {
namespace {

struct IntegerTag {
  IntegerDType dtype = IntegerDType::kBool;
  absl::string_view name;
  size_t size = 1;
};

constexpr std::array<IntegerTag, 9> kIntegerTags = {{
    {IntegerDType::kBool, "BOOL", 1},
    {IntegerDType::kUInt8, "U8", 1},
    {IntegerDType::kInt8, "I8", 1},
    {IntegerDType::kInt16, "I16", 2},
    {IntegerDType::kUInt16, "U16", 2},
    {IntegerDType::kInt32, "I32", 4},
    {IntegerDType::kUInt32, "U32", 4},
    {IntegerDType::kInt64, "I64", 8},
    {IntegerDType::kUInt64, "U64", 8},
}};

constexpr std::array<DType, 5> kDTypes = {DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                          DType::kFloat8E4M3FN, DType::kFloat8E5M2};

const IntegerTag& TagOf(IntegerDType dtype) {
  for (const IntegerTag& tag : kIntegerTags) {
    if (tag.dtype == dtype) return tag;
  }
  return kIntegerTags[0];  // unreachable: the table names every enumerator
}

}  // namespace

size_t IntegerDTypeSize(IntegerDType dtype) { return TagOf(dtype).size; }

absl::string_view IntegerDTypeSafetensorsName(IntegerDType dtype) { return TagOf(dtype).name; }

std::optional<IntegerDType> IntegerDTypeFromSafetensorsName(absl::string_view name) {
  for (const IntegerTag& tag : kIntegerTags) {
    if (tag.name == name) return tag.dtype;
  }
  return std::nullopt;
}

absl::StatusOr<SafetensorsDType> SafetensorsDType::FromName(absl::string_view name) {
  for (const DType dtype : kDTypes) {
    if (DTypeSafetensorsName(dtype) == name) return SafetensorsDType(dtype);
  }
  if (const std::optional<IntegerDType> integer = IntegerDTypeFromSafetensorsName(name)) {
    return SafetensorsDType(*integer);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors dtype '", name,
                   "' cannot be written: use F32, BF16, F16, F8_E4M3, F8_E5M2, BOOL, U8, I8, I16, "
                   "U16, I32, U32, I64 or U64"));
}

size_t SafetensorsDType::size() const {
  if (const DType* dtype = std::get_if<DType>(&value_)) return DTypeSize(*dtype);
  return IntegerDTypeSize(std::get<IntegerDType>(value_));
}

absl::string_view SafetensorsDType::name() const {
  if (const DType* dtype = std::get_if<DType>(&value_)) return DTypeSafetensorsName(*dtype);
  return IntegerDTypeSafetensorsName(std::get<IntegerDType>(value_));
}

}  // namespace layercast
