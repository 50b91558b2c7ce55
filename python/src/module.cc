// layercast's native module (_layercast): the worker library behind
// pybind11. layercast/__init__.py documents the Python API; the classes are
// in shard_set_binding.h and mirror_binding.h, the DLPack exchange in
// dlpack_views.h.
//
// Lifetimes: a tensor view holds its layer, a layer and a stream hold the
// Connection, so nothing a Python object can still reach is ever freed,
// whatever the order in which objects are dropped or closed.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdlib>

#include "client/client_defaults.h"
#include "core/optimizer_spec.h"
#include "platform/process_tuning.h"
#include "python/src/dlpack_views.h"
#include "python/src/errors.h"
#include "python/src/formats_binding.h"
#include "python/src/log_pipe.h"
#include "python/src/mirror_binding.h"
#include "python/src/shard_set_binding.h"

namespace layercast::python {
namespace {

namespace py = pybind11;

// The worker library's processes (the CLI, gather_bench) keep gRPC's
// chunk-sized receive buffers in the heap (KeepChunkBuffersInHeap); in an
// interpreter that had not, every read faulted its buffer in page by page:
// 20x the page faults and 0.77x the C++ worker's gather throughput. The
// package does the same when it loads, unless the user set glibc's
// thresholds through its environment variables.
void TuneMalloc() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    return;
  }
  KeepChunkBuffersInHeap();
}

// The worker library's defaults in the package's unit, seconds.
double Seconds(std::chrono::milliseconds duration) {
  return std::chrono::duration<double>(duration).count();
}

}  // namespace
}  // namespace layercast::python

PYBIND11_MODULE(_layercast, module) {
  using namespace layercast::python;
  module.doc() = "layercast's native module; use the layercast package.";
  TuneMalloc();
  SetErrorType(PyErr_NewExceptionWithDoc(
      "layercast.Error",
      "An error from the shards or the worker library: args (message, code), code the gRPC "
      "status name, e.g. 'NOT_FOUND'.",
      PyExc_RuntimeError, nullptr));
  module.attr("Error") = py::handle(ErrorType());

  // The worker library's defaults (client/client_defaults.h), in seconds:
  // the package's signatures read them here rather than repeat them.
  namespace client = layercast::client;
  py::module_ defaults = module.def_submodule(
      "defaults", "The worker library's defaults, in seconds (client/client_defaults.h).");
  defaults.attr("layer_timeout") = Seconds(client::kLayerTimeout);
  defaults.attr("connect_timeout") = Seconds(client::kConnectTimeout);
  defaults.attr("publish_timeout") = Seconds(client::kPublishTimeout);
  defaults.attr("mirror_poll") = Seconds(client::kMirrorPoll);
  defaults.attr("mirror_probe") = Seconds(client::kMirrorProbe);

  BindFormats(module);

  py::class_<TensorView>(module, "Tensor")
      .def_property_readonly("name", &TensorView::name)
      .def_property_readonly(
          "shape", [](const TensorView& view) { return py::tuple(py::cast(view.shape())); })
      .def_property_readonly("dtype", &TensorView::dtype)
      .def_property_readonly("nbytes", &TensorView::nbytes)
      .def_property_readonly("data_ptr", &TensorView::data_ptr)
      .def_property_readonly("block_size", &TensorView::block_size)
      .def_property_readonly("scales", &TensorView::scales)
      .def("bits", &TensorView::Bits)
      .def(
          "__dlpack__", [](const TensorView& self, py::object /*stream*/) { return self.Export(); },
          py::arg("stream") = py::none())
      .def("__dlpack_device__",
           [](const TensorView&) { return py::make_tuple(static_cast<int>(kDLCPU), 0); });

  py::class_<PyLayer>(module, "Layer")
      .def_property_readonly("index", &PyLayer::index)
      .def_property_readonly("name", &PyLayer::name)
      .def_property_readonly("version", &PyLayer::version)
      .def_property_readonly("nbytes", &PyLayer::nbytes)
      .def_property_readonly("data_ptr", &PyLayer::data_ptr)
      .def("names", &PyLayer::names)
      .def("tensor", &PyLayer::tensor);

  py::class_<PyStream>(module, "Stream")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", &PyStream::Next)
      .def_property_readonly("stats", &PyStream::Stats)
      .def("close", &PyStream::Close);

  py::class_<PyPush>(module, "Push").def("done", &PyPush::done).def("result", &PyPush::Result);

  py::class_<PyShardSet>(module, "ShardSet")
      .def_property_readonly("manifest", &PyShardSet::Manifest)
      .def_property_readonly("closed", &PyShardSet::closed)
      .def("stream", &PyShardSet::Stream, py::arg("order"), py::arg("budget_bytes"),
           py::arg("lookahead") = py::none(), py::arg("min_version") = 0,
           py::arg("version") = py::none(), py::arg("timeout") = Seconds(client::kLayerTimeout))
      .def("version", &PyShardSet::Version)
      .def("push_gradients", &PyShardSet::PushGradients, py::arg("step"), py::arg("worker"),
           py::arg("layer"), py::arg("gradients"))
      .def("finish_step", &PyShardSet::FinishStep, py::arg("step"), py::arg("worker"))
      .def("export", &PyShardSet::Export, py::arg("path"), py::arg("dtype"), py::arg("version"),
           py::arg("max_file_bytes"), py::arg("timeout"))
      .def("close", &PyShardSet::Close)
      .def(
          "mirror",
          [](const PyShardSet& self, double timeout, double poll, const std::string& dtype,
             std::optional<uint64_t> staging_bytes, const std::vector<std::string>& serve,
             const std::vector<const PyShardSet*>& fallbacks, double probe) {
            std::vector<std::shared_ptr<Connection>> held;
            for (const PyShardSet* fallback : fallbacks) held.push_back(fallback->Held());
            return MakeMirror(self.Held(), timeout, poll, dtype, staging_bytes, serve,
                              std::move(held), probe);
          },
          py::arg("timeout") = Seconds(client::kLayerTimeout),
          py::arg("poll") = Seconds(client::kMirrorPoll), py::arg("dtype") = "",
          py::arg("staging_bytes") = py::none(), py::arg("serve") = std::vector<std::string>{},
          py::arg("fallbacks") = std::vector<const PyShardSet*>{},
          py::arg("probe") = Seconds(client::kMirrorProbe))
      .def(
          "publish",
          [](const PyShardSet& self, const py::dict& values, const std::string& admin_token,
             std::optional<uint64_t> base_version, double timeout, bool insecure) {
            return Publish(*self.Held(), values, admin_token, base_version, timeout, insecure);
          },
          py::arg("values"), py::arg("admin_token"), py::arg("base_version") = py::none(),
          py::arg("timeout") = Seconds(client::kPublishTimeout), py::arg("insecure") = false);

  py::class_<PyMirrorReading>(module, "MirrorReading")
      .def_property_readonly("version", &PyMirrorReading::version)
      .def_property_readonly("num_layers", &PyMirrorReading::num_layers)
      .def("layer", &PyMirrorReading::Layer)
      .def("check", &PyMirrorReading::Check)
      .def("close", &PyMirrorReading::Close);

  py::class_<PyMirror>(module, "Mirror")
      .def_property_readonly("version", &PyMirror::version)
      .def("update", &PyMirror::Update, py::arg("min_version") = py::none())
      .def("wait_for_version", &PyMirror::WaitForVersion, py::arg("version"),
           py::arg("timeout") = 30.0)
      .def("follow", &PyMirror::Follow, py::arg("on_update") = py::none())
      .def("stop", &PyMirror::Stop)
      .def_property_readonly("addresses", &PyMirror::addresses)
      .def_property_readonly("source", &PyMirror::source)
      .def("read", &PyMirror::Read);

  module.def(
      "learning_rate",
      [](const std::string& optimizer, uint64_t step, const std::string& tensor) {
        const layercast::OptimizerSpec spec =
            ValueOrRaise(layercast::OptimizerSpec::Parse(optimizer));
        return spec.LearningRate(spec.HyperFor(tensor), step);
      },
      py::arg("optimizer"), py::arg("step"), py::arg("tensor") = "");
  module.def("route_logs", &RouteLogsToPipe, py::arg("fd"));
  module.def("connect", &Connect, py::arg("shards"), py::arg("tls") = py::none(),
             py::arg("timeout") = Seconds(client::kConnectTimeout), py::arg("worker_token") = "",
             py::arg("insecure") = false);
}
