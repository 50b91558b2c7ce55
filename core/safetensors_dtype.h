#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <variant>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"

namespace layercast {

// The integer and boolean dtypes of the safetensors format. A shard serves
// none of them (it skips position ids, masks, BatchNorm's
// num_batches_tracked), but files carry them through: a model saved from a
// state_dict() holds them, and so does torch's optimizer state.
enum class IntegerDType : uint8_t {
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kUInt16,
  kInt32,
  kUInt32,
  kInt64,
  kUInt64,
};

// Bytes per element: 1 for kBool (a byte per value, as torch stores it).
size_t IntegerDTypeSize(IntegerDType dtype);

// The safetensors tag: "BOOL", "U8", "I8", "I16", "U16", "I32", "U32",
// "I64", "U64".
absl::string_view IntegerDTypeSafetensorsName(IntegerDType dtype);

// Parses one of those tags; nullopt for any other name, floats included.
std::optional<IntegerDType> IntegerDTypeFromSafetensorsName(absl::string_view name);

// A tensor's dtype as a safetensors file declares it: one a shard serves or
// computes in (DType), or an integer or boolean one it only carries.
class SafetensorsDType {
 public:
  // Implicit on purpose: every DType is a dtype a file holds, so code that
  // writes floats names a DType as it always has.
  SafetensorsDType(DType dtype) : value_(dtype) {}         // NOLINT(google-explicit-constructor)
  SafetensorsDType(IntegerDType dtype) : value_(dtype) {}  // NOLINT(google-explicit-constructor)

  // Parses every tag the writer writes: DTypeSafetensorsName's ("F32",
  // "BF16", "F16", "F8_E4M3", "F8_E5M2") and IntegerDTypeSafetensorsName's.
  // INVALID_ARGUMENT naming the tag and the accepted ones otherwise (F64,
  // for instance).
  static absl::StatusOr<SafetensorsDType> FromName(absl::string_view name);

  size_t size() const;
  absl::string_view name() const;

  bool operator==(const SafetensorsDType&) const = default;

 private:
  std::variant<DType, IntegerDType> value_;
};

}  // namespace layercast
