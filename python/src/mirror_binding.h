#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "client/model_mirror.h"
#include "python/src/connection.h"
#include "python/src/shard_set_binding.h"
#include "relay/relay.h"

namespace layercast::python {

// What a Python Mirror, its readings and the tensors taken through them
// hold: the mirror, and the connection its shard set lives in.
struct HeldMirror {
  std::shared_ptr<Connection> connection;
  // The sets the mirror falls back to (MirrorOptions::fallbacks); they
  // outlive it.
  std::vector<std::shared_ptr<Connection>> fallbacks;
  // Serving the mirror's layers (ShardSet.mirror(serve=...)); outlives the
  // mirror, which tells it of each layer.
  std::unique_ptr<relay::Relay> relay;
  std::unique_ptr<client::ModelMirror> mirror;
  ~HeldMirror();
};

// A Reading of the mirror (updates held off) as a Python object: taken on
// entering a `with` block, released on leaving it (or by close()).
class PyMirrorReading {
 public:
  explicit PyMirrorReading(std::shared_ptr<HeldMirror> held);
  uint64_t version() const;
  uint32_t num_layers() const;
  // The layer as a view of the mirror's buffer: its tensors alias the
  // mirror, whose values move on with each update once the reading ends.
  PyLayer Layer(uint32_t index) const;
  // Raises layercast.Error (DATA_LOSS) naming layers a failed pull left torn.
  void Check() const;
  void Close();

 private:
  const client::ModelMirror::Reading& Held() const;
  std::shared_ptr<HeldMirror> held_;
  std::unique_ptr<client::ModelMirror::Reading> reading_;
};

class PyMirror {
 public:
  explicit PyMirror(std::shared_ptr<HeldMirror> held) : held_(std::move(held)) {}
  // Without the GIL: another thread's reading may hold the mirror.
  uint64_t version() const;
  pybind11::dict Update(std::optional<uint64_t> min_version);
  bool WaitForVersion(uint64_t version, double timeout);
  // `on_update` is called on the follower's thread, with the GIL, with the
  // update's dict; what it raises is reported as unraisable.
  void Follow(std::optional<pybind11::function> on_update);
  void Stop();
  PyMirrorReading Read() const { return PyMirrorReading(held_); }
  // Where the mirror serves the set's reads (its relay's addresses, in
  // shard order); empty when it does not.
  std::vector<std::string> addresses() const;
  // The addresses of the set it pulls from now (ModelMirror::source).
  std::vector<std::string> source() const;

 private:
  std::shared_ptr<HeldMirror> held_;
};

// ShardSet.mirror: pulls every layer in full (without the GIL).
// `dtype`: MirrorOptions::dtype by name ("float8_e4m3fn"); empty for the
// policy's dtypes.
// `staging_bytes`: MirrorOptions::staging_bytes; nullopt: its default.
// `serve`: one host:port per shard where the mirror serves the set's reads
// (relay::Relay); empty: it does not.
// `fallbacks`: MirrorOptions::fallbacks, in order; `probe` (seconds):
// MirrorOptions::probe.
PyMirror MakeMirror(std::shared_ptr<Connection> connection, double layer_timeout, double poll,
                    const std::string& dtype, std::optional<uint64_t> staging_bytes,
                    const std::vector<std::string>& serve,
                    std::vector<std::shared_ptr<Connection>> fallbacks, double probe);

// ShardSet.publish: `values` {tensor name: fp32 tensor}, taken without a copy;
// `insecure` lets the token go over a plaintext connection.
pybind11::dict Publish(const Connection& connection, const pybind11::dict& values,
                       const std::string& admin_token, std::optional<uint64_t> base_version,
                       double timeout, bool insecure);

}  // namespace layercast::python
