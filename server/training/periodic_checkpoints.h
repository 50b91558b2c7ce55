#pragma once

#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "server/serving/version_gate.h"

namespace layercast::server {

// A training shard's checkpoint each time the model's version reaches a
// multiple of `every` steps (--checkpoint-every), written on a thread of
// its own: the push that completes the step is answered at once, and the
// steps after it wait only while the write holds the layers
// (LayerTrainer::WriteWithState). A write that fails is logged and tried
// again at the next multiple; the previous checkpoint and the push journal
// stay meanwhile.
class PeriodicCheckpoints {
 public:
  using Write = std::function<absl::StatusOr<CheckpointInfo>()>;

  // `gate` must outlive this; `every` > 0.
  PeriodicCheckpoints(VersionGate& gate, uint64_t every, Write write);
  // Waits for a write in progress, then stops.
  ~PeriodicCheckpoints();

 private:
  void Run();
  // Blocks until the model reaches `version`; false when stopping first.
  bool AwaitVersion(uint64_t version);

  VersionGate& gate_;
  const uint64_t every_;
  const Write write_;
  absl::Mutex mu_;
  bool reached_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it uses everything above
};

}  // namespace layercast::server
