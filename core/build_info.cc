#include "core/build_info.h"

#include "absl/strings/str_cat.h"
#include "core/build_info_values.h"  // generated
#include "core/cast.h"

namespace layercast {

BuildInfo GetBuildInfo() {
  return BuildInfo{LAYERCAST_VERSION, LAYERCAST_GIT_COMMIT, LAYERCAST_BUILD_TYPE,
                   SelectedCastIsa().Summary()};
}

std::string VersionLine(const std::string& program) {
  const BuildInfo info = GetBuildInfo();
  return absl::StrCat(program, " ", info.version, " (commit ", info.git_commit, ", ",
                      info.build_type, " build, cast kernel ", info.cast_kernel, ")");
}

}  // namespace layercast
