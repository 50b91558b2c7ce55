#pragma once

#include <string>

namespace layercast {

// What `--version` prints and the build-info metric carries.
struct BuildInfo {
  std::string version;      // the project's, e.g. "0.1.0"
  std::string git_commit;   // short hash the build was configured at; "unknown" outside git
  std::string build_type;   // CMAKE_BUILD_TYPE, e.g. "Release"
  std::string cast_kernel;  // CastIsaSelection::Summary(), e.g. "avx2"
};

BuildInfo GetBuildInfo();

// "layercast-shard 0.1.0 (commit 1a2b3c4, Release build, cast kernel avx2)".
std::string VersionLine(const std::string& program);

}  // namespace layercast
