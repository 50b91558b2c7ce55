#pragma once

// What a test does when something it needs from the machine is missing
// (PyTorch, the openssl command): on a developer's machine it skips, saying
// what is missing and that it did not run; under CI (LAYERCAST_CI=1, which
// .ci/run sets) it fails with the same message, for there
// scripts/install-deps.sh installs everything and a missing piece means the
// check it guards silently stopped running. tests/deploy/image_test.sh and
// python/CMakeLists.txt (LAYERCAST_REQUIRE_ALL) follow the same rule.

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace layercast::testing {

// Whether this run is CI's: LAYERCAST_CI=1 in the environment.
inline bool UnderCi() {
  const char* ci = std::getenv("LAYERCAST_CI");
  return ci != nullptr && std::strcmp(ci, "1") == 0;
}

}  // namespace layercast::testing

// Ends the current test because `missing` (a std::string or a C string
// saying what is missing and how to install it) is not there: a skip, or a
// failure under CI. Use it where GTEST_SKIP() would go (a TEST body or
// SetUp).
#define LAYERCAST_PREREQUISITE_MISSING(missing)                                                \
  do {                                                                                         \
    const std::string layercast_missing_(missing);                                             \
    if (::layercast::testing::UnderCi()) {                                                     \
      FAIL() << layercast_missing_                                                             \
             << " (a failure under CI, LAYERCAST_CI=1: scripts/install-deps.sh installs it)";  \
    } else {                                                                                   \
      GTEST_SKIP() << layercast_missing_                                                       \
                   << " (skipped: this check did not run; LAYERCAST_CI=1 makes it a failure)"; \
    }                                                                                          \
  } while (0)
