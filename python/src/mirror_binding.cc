#include "python/src/mirror_binding.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/weight_publisher.h"
#include "python/src/dlpack_views.h"
#include "python/src/errors.h"

namespace layercast::python {
namespace {

namespace py = pybind11;

std::chrono::milliseconds Milliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

py::dict UpdateDict(const client::MirrorUpdate& update) {
  py::dict out;
  out["version"] = update.version;
  out["layers"] = update.layers;
  out["bytes"] = update.bytes;
  out["changed_layers"] = update.changed_layers;  // indices; the package names them
  out["seconds"] = std::chrono::duration<double>(update.duration).count();
  out["staged_layers"] = update.staged_layers;
  out["pause_seconds"] = std::chrono::duration<double>(update.pause).count();
  return out;
}

// Runs `f` without the GIL when the calling thread holds it (a Python
// object's dealloc may or may not), so that a follower waiting for the GIL
// can finish.
template <typename F>
void WithoutGil(F&& f) {
  const bool holds_gil = Py_IsInitialized() && PyGILState_Check();
  PyThreadState* saved = holds_gil ? PyEval_SaveThread() : nullptr;
  f();
  if (saved != nullptr) PyEval_RestoreThread(saved);
}

}  // namespace

HeldMirror::~HeldMirror() {
  // The relay after the mirror that tells it of layers; its stop waits for
  // the calls it serves, which need no GIL.
  WithoutGil([this] {
    mirror.reset();
    relay.reset();
  });
}

PyMirrorReading::PyMirrorReading(std::shared_ptr<HeldMirror> held) : held_(std::move(held)) {
  py::gil_scoped_release release;  // an update in flight holds readers off
  // Neither copied nor moved: made in place from Read()'s prvalue.
  reading_.reset(new client::ModelMirror::Reading(held_->mirror->Read()));
}

const client::ModelMirror::Reading& PyMirrorReading::Held() const {
  if (reading_ == nullptr) {
    Raise(absl::FailedPreconditionError(
        "this reading is closed: read the mirror again (with mirror.read() as r: ...)"));
  }
  return *reading_;
}

uint64_t PyMirrorReading::version() const { return Held().version(); }
uint32_t PyMirrorReading::num_layers() const { return Held().num_layers(); }

PyLayer PyMirrorReading::Layer(uint32_t index) const {
  const client::ModelMirror::Reading& reading = Held();
  if (index >= reading.num_layers()) {
    throw py::index_error(
        absl::StrCat("there is no layer ", index, "; the model has ", reading.num_layers()));
  }
  return PyLayer(std::shared_ptr<const client::Layer>(held_, &reading.layer(index)));
}

void PyMirrorReading::Check() const {
  if (absl::Status status = Held().status(); !status.ok()) Raise(status);
}

void PyMirrorReading::Close() { reading_.reset(); }

uint64_t PyMirror::version() const {
  py::gil_scoped_release release;
  return held_->mirror->version();
}

py::dict PyMirror::Update(std::optional<uint64_t> min_version) {
  absl::StatusOr<client::MirrorUpdate> update;
  {
    py::gil_scoped_release release;
    update = held_->mirror->Update(min_version);
  }
  return UpdateDict(ValueOrRaise(std::move(update)));
}

bool PyMirror::WaitForVersion(uint64_t version, double timeout) {
  py::gil_scoped_release release;
  return held_->mirror->WaitForVersion(version, Milliseconds(timeout));
}

void PyMirror::Follow(std::optional<py::function> on_update) {
  std::function<void(const client::MirrorUpdate&)> callback;
  if (on_update) {
    // Dropped with the GIL, on whichever thread drops the follower.
    std::shared_ptr<py::function> function(new py::function(*std::move(on_update)),
                                           [](py::function* f) {
                                             py::gil_scoped_acquire gil;
                                             delete f;
                                           });
    callback = [function](const client::MirrorUpdate& update) {
      py::gil_scoped_acquire gil;
      try {
        (*function)(UpdateDict(update));
      } catch (py::error_already_set& error) {
        error.discard_as_unraisable("layercast.Mirror.follow callback");
      }
    };
  }
  py::gil_scoped_release release;
  held_->mirror->Follow(std::move(callback));
}

void PyMirror::Stop() {
  py::gil_scoped_release release;  // the follower's callback may wait for the GIL
  held_->mirror->StopFollowing();
}

std::vector<std::string> PyMirror::addresses() const {
  return held_->relay != nullptr ? held_->relay->addresses() : std::vector<std::string>{};
}

std::vector<std::string> PyMirror::source() const { return held_->mirror->source().addresses(); }

PyMirror MakeMirror(std::shared_ptr<Connection> connection, double layer_timeout, double poll,
                    const std::string& dtype, std::optional<uint64_t> staging_bytes,
                    const std::vector<std::string>& serve,
                    std::vector<std::shared_ptr<Connection>> fallbacks, double probe) {
  client::MirrorOptions options;
  if (staging_bytes) options.staging_bytes = *staging_bytes;
  options.layer_timeout = Milliseconds(layer_timeout);
  options.poll = Milliseconds(poll);
  options.probe = Milliseconds(probe);
  for (const std::shared_ptr<Connection>& fallback : fallbacks) {
    options.fallbacks.push_back(fallback->set.get());
  }
  if (!dtype.empty()) options.dtype = ValueOrRaise(DTypeFromName(dtype));
  auto held = std::make_shared<HeldMirror>();
  held->fallbacks = std::move(fallbacks);
  if (!serve.empty()) {
    relay::RelayOptions relay;
    relay.listen = serve;
    relay.dtype = options.dtype;
    held->relay = ValueOrRaise(relay::Relay::Start(*connection->set, relay));
    options.listener = held->relay.get();
  }
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> mirror;
  {
    py::gil_scoped_release release;
    mirror = client::ModelMirror::Create(*connection->set, options);
  }
  held->mirror = ValueOrRaise(std::move(mirror));
  held->connection = std::move(connection);
  return PyMirror(std::move(held));
}

py::dict Publish(const Connection& connection, const py::dict& values,
                 const std::string& admin_token, std::optional<uint64_t> base_version,
                 double timeout, bool insecure) {
  const ModelSpec& model = connection.set->model();
  std::map<std::string, const TensorSpec*> specs;
  for (const LayerSpec& layer : model.layers) {
    for (const TensorSpec& tensor : layer.tensors) specs.emplace(tensor.name, &tensor);
  }
  std::vector<ImportedTensor> held;
  client::TensorValues view;
  for (const auto& [key, tensor] : values) {
    const std::string name = py::str(key);
    const auto spec = specs.find(name);
    if (spec == specs.end()) {
      throw py::key_error(absl::StrCat(name, " is not in the model (", model.model_id, ")"));
    }
    held.push_back(ImportTensor(tensor, *spec->second, DType::kFloat32, "new values"));
    view.emplace(name, std::span<const float>(reinterpret_cast<const float*>(held.back().data()),
                                              spec->second->num_elements));
  }
  absl::StatusOr<client::PublishResult> published;
  {
    py::gil_scoped_release release;
    client::WeightPublisher publisher(
        *connection.set,
        {.admin_token = admin_token, .insecure = insecure, .timeout = Milliseconds(timeout)});
    published = publisher.Publish(view, base_version);
  }
  const client::PublishResult result = ValueOrRaise(std::move(published));
  py::dict out;
  out["version"] = result.version;
  out["changed_elements"] = result.changed_elements;
  out["layer_by_layer"] = result.layer_by_layer;
  out["versions"] = result.versions;
  return out;
}

}  // namespace layercast::python
