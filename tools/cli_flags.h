#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace layercast::tools {

// The flags of one `layercast` subcommand: `--name VALUE` or `--name=VALUE`,
// each name from the subcommand's known set, and switches, `--name` alone.
// Not thread-safe.
class CliFlags {
 public:
  // INVALID_ARGUMENT naming an unknown flag, a missing value, a value given
  // to a switch or a stray word. `switches` take no value: the word after
  // one is read as the next flag.
  static absl::StatusOr<CliFlags> Parse(const std::vector<std::string>& args,
                                        const std::set<std::string>& known,
                                        const std::set<std::string>& switches = {});

  // Whether the flag or switch was given.
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  // INVALID_ARGUMENT if present and not an unsigned integer.
  absl::StatusOr<uint64_t> GetUint(const std::string& name, uint64_t fallback) const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace layercast::tools
