#include "platform/flag_value.h"

#include "absl/strings/str_cat.h"

namespace layercast {

absl::StatusOr<std::pair<std::string, std::string>> TakeFlag(const std::vector<std::string>& args,
                                                             size_t* i) {
  std::string name = args[*i].substr(2), value;
  if (const size_t eq = name.find('='); eq != std::string::npos) {
    value = name.substr(eq + 1);
    name.resize(eq);
  } else if (*i + 1 < args.size()) {
    value = args[++*i];
  } else {
    return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
  }
  return std::make_pair(std::move(name), std::move(value));
}

}  // namespace layercast
