#include "tools/cli_flags.h"

#include <charconv>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "platform/flag_value.h"
#include "platform/status_macros.h"

namespace layercast::tools {

absl::StatusOr<CliFlags> CliFlags::Parse(const std::vector<std::string>& args,
                                         const std::set<std::string>& known,
                                         const std::set<std::string>& switches) {
  CliFlags flags;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!absl::StartsWith(args[i], "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", args[i], "'"));
    }
    if (switches.count(args[i].substr(2)) > 0) {
      flags.values_[args[i].substr(2)] = "";
      continue;
    }
    ASSIGN_OR_RETURN(auto flag, TakeFlag(args, &i));
    auto& [name, value] = flag;
    if (switches.count(name) > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " takes no value; give it alone, not --", name, "=", value));
    }
    if (known.count(name) == 0) {
      std::set<std::string> all = known;
      all.insert(switches.begin(), switches.end());
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown flag --", name, "; this command takes --", absl::StrJoin(all, ", --")));
    }
    flags.values_[name] = value;
  }
  return flags;
}

std::string CliFlags::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

absl::StatusOr<uint64_t> CliFlags::GetUint(const std::string& name, uint64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& text = it->second;
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " takes an unsigned integer, not '", text, "'"));
  }
  return value;
}

}  // namespace layercast::tools
