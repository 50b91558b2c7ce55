#pragma once

#include "absl/strings/string_view.h"

namespace layercast {

// Whether the whole of `name` matches the fnmatch(3) glob `glob` with no
// flags: `*` and `?` also match '.' and '/', `[...]` is a character class and
// a backslash quotes the next character. Every per-tensor rule in layercast
// (precision policy overrides, optimizer overrides) matches tensor names with
// this one function, so a glob means the same thing everywhere.
//
// Thread-safe.
bool GlobMatches(absl::string_view glob, absl::string_view name);

}  // namespace layercast
