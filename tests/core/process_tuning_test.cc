// Abseil's lock-order checks: on in the test binaries, off after
// SkipLockOrderChecks, and kept by LAYERCAST_LOCK_ORDER_CHECKS=1 (which the
// tests that start the programs set). Each case runs in a child process, so
// the switch never reaches the other tests.

#include <gtest/gtest.h>

#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "core/process_tuning.h"

namespace layercast {
namespace {

// Takes two locks in one order, then in the other: an inversion, which the
// checks report and abort on.
void InvertLockOrder() {
  absl::Mutex first, second;
  {
    absl::MutexLock a(&first);
    absl::MutexLock b(&second);
  }
  {
    absl::MutexLock b(&second);
    absl::MutexLock a(&first);
  }
}

TEST(ProcessTuningDeathTest, TheTestsKeepTheLockOrderChecks) {
  EXPECT_DEATH(InvertLockOrder(), "deadlock");
}

TEST(ProcessTuningDeathTest, SkipLockOrderChecksTurnsThemOff) {
  EXPECT_EXIT(
      {
        unsetenv("LAYERCAST_LOCK_ORDER_CHECKS");
        SkipLockOrderChecks();
        InvertLockOrder();
        std::_Exit(0);  // no exit handlers: a sanitizer's leak check is not the question
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ProcessTuningDeathTest, TheVariableKeepsThem) {
  EXPECT_DEATH(
      {
        setenv("LAYERCAST_LOCK_ORDER_CHECKS", "1", 1);
        SkipLockOrderChecks();
        InvertLockOrder();
      },
      "deadlock");
}

}  // namespace
}  // namespace layercast
