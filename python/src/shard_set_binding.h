#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/gradient_sink.h"
#include "client/layer_stream.h"
#include "python/src/connection.h"
#include "python/src/dlpack_views.h"

namespace layercast::python {

// The classes behind layercast.ShardSet, LayerStream, Layer and PushResult:
// thin holders of the worker library's objects, each holding the Connection
// it needs, releasing the GIL wherever the library may block. Python's
// layercast/__init__.py documents them for users.

class PyLayer {
 public:
  // `held`: as TensorView's.
  explicit PyLayer(std::shared_ptr<const client::Layer> held) : held_(std::move(held)) {}
  uint32_t index() const { return held_->index(); }
  std::string name() const { return held_->name(); }
  uint64_t version() const { return held_->version(); }
  uint64_t nbytes() const { return held_->bytes().size(); }
  uintptr_t data_ptr() const;
  std::vector<std::string> names() const;
  // KeyError naming the layer when it has no tensor `name`.
  TensorView tensor(const std::string& name) const;

 private:
  std::shared_ptr<const client::Layer> held_;
};

class PyStream {
 public:
  PyStream(std::shared_ptr<Connection> connection, std::unique_ptr<client::LayerStream> stream)
      : connection_(std::move(connection)), stream_(std::move(stream)) {}

  // The next layer; StopIteration after the last or once closed.
  PyLayer Next();
  pybind11::dict Stats() const;
  // Cancels what is in flight; layers handed out stay valid. A Next()
  // running on another thread keeps the stream until it returns.
  void Close();

 private:
  std::shared_ptr<Connection> connection_;
  std::shared_ptr<client::LayerStream> stream_;
};

// The pending answer to one push_gradients.
class PyPush {
 public:
  explicit PyPush(std::shared_future<absl::StatusOr<client::PushResult>> future)
      : future_(std::move(future)) {}
  bool done() const;
  pybind11::dict Result() const;

 private:
  std::shared_future<absl::StatusOr<client::PushResult>> future_;
};

class PyShardSet {
 public:
  explicit PyShardSet(std::shared_ptr<Connection> connection)
      : connection_(std::move(connection)) {}

  pybind11::dict Manifest() const;
  // `version`: a walk pinned to it (GatherOptions.exact_version).
  PyStream Stream(std::vector<uint32_t> order, uint64_t budget_bytes,
                  std::optional<uint32_t> lookahead, uint64_t min_version,
                  std::optional<uint64_t> version, double timeout);
  // ShardSet::CurrentVersion, without the GIL.
  uint64_t Version() const;
  PyPush PushGradients(uint64_t step, uint32_t worker, uint32_t layer,
                       const pybind11::dict& gradients);
  pybind11::dict FinishStep(uint64_t step, uint32_t worker);
  // client::ExportModel, without the GIL: {version, bytes, tensors, files}.
  pybind11::dict Export(const std::string& path, const std::string& dtype,
                        std::optional<uint64_t> version, uint64_t max_file_bytes,
                        double timeout) const;
  // Drops this object's hold on the connection once the pushes handed over
  // are done; layers and tensors still held keep what they need.
  void Close();
  bool closed() const { return connection_ == nullptr; }
  // The connection, or FAILED_PRECONDITION once closed. Copied under the
  // GIL, so a close() on another thread cannot free it mid-call.
  std::shared_ptr<Connection> Held() const;

 private:
  std::shared_ptr<Connection> connection_;
};

// `tls`: {root_certificates, certificate_chain, private_key}, PEM strings.
// `worker_token` (empty: none): sent with this connection's pushes and clip
// scales; refused over plaintext unless `insecure`.
PyShardSet Connect(std::vector<std::string> addresses, std::optional<pybind11::dict> tls,
                   double timeout, const std::string& worker_token, bool insecure);

}  // namespace layercast::python
