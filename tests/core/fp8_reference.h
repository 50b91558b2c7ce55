#pragma once

// An independent fp8 reference written from the OCP 8-bit Floating Point
// Specification: every finite code's value computed from its fields in
// double, and rounding by comparing distances to the two neighbouring values.
// It shares nothing with core/fp8.cc's bit manipulation.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/fp8.h"

namespace layercast::fp8_reference {

struct Format {
  int exponent_bits;
  int mantissa_bits;
  uint8_t max_code;  // largest finite, positive
  uint8_t nan_code;  // the NaN core/fp8.h's contract gives, positive
  // values[c]: the value of positive code c, for c = 0 ... max_code.
  std::vector<double> values;
};

inline Format MakeFormat(Fp8Format format) {
  Format f =
      format == Fp8Format::kE4M3FN ? Format{4, 3, 0x7E, 0x7F, {}} : Format{5, 2, 0x7B, 0x7E, {}};
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  for (int code = 0; code <= f.max_code; ++code) {
    const int exponent = code >> f.mantissa_bits;
    const int mantissa = code & ((1 << f.mantissa_bits) - 1);
    const double fraction = mantissa / static_cast<double>(1 << f.mantissa_bits);
    f.values.push_back(exponent == 0 ? std::ldexp(fraction, 1 - bias)
                                     : std::ldexp(1.0 + fraction, exponent - bias));
  }
  return f;
}

// The code of y (already divided by its scale): nearest, ties to the even
// code, saturating beyond the largest finite value, NaN to NaN. `hint` is a
// code at or below the answer's (0 when unknown): callers walking magnitudes
// upwards pass the previous answer and the search costs one step or two.
inline uint8_t Encode(float y, const Format& f, uint8_t* hint = nullptr) {
  const uint8_t sign = std::signbit(y) ? 0x80 : 0;
  if (std::isnan(y)) return sign | f.nan_code;
  const double a = std::fabs(static_cast<double>(y));
  if (a >= f.values[f.max_code]) return sign | f.max_code;
  size_t low = hint != nullptr ? *hint : 0;
  if (f.values[low] > a) low = 0;
  while (f.values[low + 1] <= a) ++low;  // values[max_code] > a stops it
  if (hint != nullptr) *hint = static_cast<uint8_t>(low);
  const double below = a - f.values[low], above = f.values[low + 1] - a;
  size_t code = low;
  if (above < below || (above == below && (low & 1) != 0)) code = low + 1;
  return sign | static_cast<uint8_t>(code);
}

}  // namespace layercast::fp8_reference
