// Abseil's lock-order checks: on in the test binaries, off after
// SkipLockOrderChecks or TuneOwnProcess, and kept by TuneOwnProcess(true)
// (what a program passes when the tests that start it set
// LAYERCAST_LOCK_ORDER_CHECKS=1). Each case runs in a child process, so
// the switch never reaches the other tests.

#include <gtest/gtest.h>

#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "platform/process_tuning.h"

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

TEST(ProcessTuningDeathTest, TuningTheProcessTurnsThemOff) {
  EXPECT_EXIT(
      {
        TuneOwnProcess(/*keep_lock_order_checks=*/false);
        InvertLockOrder();
        std::_Exit(0);  // no exit handlers: a sanitizer's leak check is not the question
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ProcessTuningDeathTest, AProgramAskedToKeepThemKeepsThem) {
  EXPECT_DEATH(
      {
        TuneOwnProcess(/*keep_lock_order_checks=*/true);
        InvertLockOrder();
      },
      "deadlock");
}

}  // namespace
}  // namespace layercast
