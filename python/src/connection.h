#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/gradient_sink.h"
#include "client/layer.h"
#include "client/shard_set.h"

namespace layercast::python {

// What a Python ShardSet holds: the connection, and the gradient sinks made
// for it (one per worker index). Shared by the ShardSet object, its streams
// and every layer gathered from it, so whichever of them goes last frees it.
struct Connection {
  std::unique_ptr<client::ShardSet> set;
  // Sent with this process's pushes and clip scales (--worker-token-dir);
  // empty: none.
  std::string worker_token;
  bool insecure = false;  // the token may go over plaintext
  absl::Mutex mu;
  std::map<uint32_t, std::unique_ptr<client::GradientSink>> sinks ABSL_GUARDED_BY(mu);

  ~Connection() {
    // Sinks finish their pushes (joining their threads) before the set they
    // push through goes; without the GIL, when this runs under it (a Python
    // object's dealloc), so that other Python threads go on meanwhile.
    const bool holds_gil = Py_IsInitialized() && PyGILState_Check();
    PyThreadState* saved = holds_gil ? PyEval_SaveThread() : nullptr;
    {
      absl::MutexLock lock(&mu);
      sinks.clear();
    }
    set.reset();
    if (saved != nullptr) PyEval_RestoreThread(saved);
  }
};

// A gathered layer and what keeps its spec and layout alive.
struct HeldLayer {
  std::shared_ptr<Connection> connection;
  client::Layer layer;
};

}  // namespace layercast::python
