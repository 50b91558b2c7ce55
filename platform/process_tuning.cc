#include "platform/process_tuning.h"

#include <malloc.h>

#include "absl/synchronization/mutex.h"

namespace layercast {

void KeepChunkBuffersInHeap() {
  // Setting either also turns off glibc's own threshold adjustment, which
  // raises the mmap threshold only after a large block is freed and, with
  // blocks freed on other threads than allocated them, often never does.
  mallopt(M_MMAP_THRESHOLD, 4 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

void SkipLockOrderChecks() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

void TuneOwnProcess(bool keep_lock_order_checks) {
  KeepChunkBuffersInHeap();
  if (!keep_lock_order_checks) SkipLockOrderChecks();
}

}  // namespace layercast
