#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/version_gate.h"

namespace layercast::server {

// A training shard's checkpoint each time the model's version reaches a
// multiple of `every` steps (--checkpoint-every), written on the shard's
// background thread: the push that completes the step is answered at once,
// and the steps after it wait only while the write holds the layers
// (TrainerCheckpoint::WriteWithState). No thread waits in between: the version
// gate posts the multiple's arrival. A write that fails is logged and tried
// again at the next multiple; the previous checkpoint and the push journal
// stay meanwhile.
class PeriodicCheckpoints {
 public:
  using Write = std::function<absl::StatusOr<CheckpointInfo>()>;

  // `gate` and `background` (the shard's background thread; null: a thread
  // of its own) must outlive this; `every` > 0.
  PeriodicCheckpoints(VersionGate& gate, uint64_t every, Write write,
                      DeadlineTimers* background = nullptr);
  // Waits for a write in progress; none starts after.
  ~PeriodicCheckpoints();

  // Whether a write is under way (from its first step, the layers' pause):
  // ShardAdmin.Checkpoint refuses one asked for meanwhile with ABORTED, as
  // its contract says, rather than queue it behind this one on the shard's
  // background thread.
  bool writing() const { return writing_.load(); }

 private:
  // What the gate's callback reaches this through: null once this is going,
  // so that a callback already posted when the wait is withdrawn does
  // nothing (the gate runs it on its executor, not on work_).
  struct Link {
    absl::Mutex mu;
    PeriodicCheckpoints* self ABSL_GUARDED_BY(mu) = nullptr;
    uint64_t wait ABSL_GUARDED_BY(mu) = 0;  // the gate's id of the wait
  };
  // Waits on the gate for the first multiple of every_ above `version`.
  void Arm(uint64_t version);
  // On work_: writes the checkpoint for `next`, then arms the next.
  void Reached(uint64_t next);

  VersionGate& gate_;
  const uint64_t every_;
  const Write write_;
  const std::shared_ptr<Link> link_ = std::make_shared<Link>();
  std::atomic<bool> writing_{false};
  DeadlineTimers work_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
