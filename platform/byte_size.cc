#include "platform/byte_size.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace layercast {
namespace {

struct Suffix {
  absl::string_view name;
  double scale;
};

// Longest first where one ends another ("MiB" before "B"). The Kubernetes
// quantity suffixes (Ki, Mi, Gi, Ti; k, M, G, T) are here because the same
// budget is written next to a container's memory limit in a manifest.
constexpr Suffix kSuffixes[] = {
    {"KiB", 1024.0},
    {"MiB", 1048576.0},
    {"GiB", 1073741824.0},
    {"TiB", 1099511627776.0},
    {"KB", 1e3},
    {"MB", 1e6},
    {"GB", 1e9},
    {"TB", 1e12},
    {"Ki", 1024.0},
    {"Mi", 1048576.0},
    {"Gi", 1073741824.0},
    {"Ti", 1099511627776.0},
    {"k", 1e3},
    {"M", 1e6},
    {"G", 1e9},
    {"T", 1e12},
    {"B", 1.0},
};

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  const auto invalid = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a byte size: write a number with an optional suffix B, KiB, MiB, ",
        "GiB, TiB, KB, MB, GB or TB, or a Kubernetes quantity suffix Ki, Mi, Gi, Ti, k, M, G ",
        "or T, e.g. 16GiB or 16Gi"));
  };
  double scale = 1.0;
  absl::string_view number = text;
  for (const Suffix& suffix : kSuffixes) {
    if (number.size() > suffix.name.size() &&
        number.substr(number.size() - suffix.name.size()) == suffix.name) {
      number.remove_suffix(suffix.name.size());
      scale = suffix.scale;
      break;
    }
  }
  if (number.empty() || !std::isdigit(static_cast<unsigned char>(number[0]))) return invalid();
  for (char c : number) {
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.') return invalid();
  }
  const std::string digits(number);
  char* end = nullptr;
  const double value = std::strtod(digits.c_str(), &end);
  if (end != digits.c_str() + digits.size() || !std::isfinite(value)) return invalid();
  const double bytes = std::floor(value * scale);
  if (bytes >= 18446744073709551615.0) {
    return absl::OutOfRangeError(absl::StrCat("byte size '", text, "' exceeds 2^64-1 bytes"));
  }
  return static_cast<uint64_t>(bytes);
}

std::string FormatBytes(uint64_t bytes) {
  constexpr absl::string_view kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return absl::StrCat(bytes, " B");
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.2f ", value);
  return absl::StrCat(buffer, kUnits[unit]);
}

}  // namespace layercast
