#include "platform/glob.h"

#include <fnmatch.h>

#include <string>

namespace layercast {

bool GlobMatches(absl::string_view glob, absl::string_view name) {
  // fnmatch needs NUL-terminated strings; string_views need not be.
  const std::string glob_text(glob), name_text(name);
  return fnmatch(glob_text.c_str(), name_text.c_str(), 0) == 0;
}

}  // namespace layercast
