// The layercast Python package's native half: the worker library
// (client::ShardSet, client::LayerStream, client::GradientSink) behind
// pybind11, with every tensor of a gathered layer handed out as a zero-copy
// DLPack view of the layer's buffer. layercast/__init__.py documents the
// Python API; this file holds only what crosses the language boundary.
//
// Lifetimes: a view holds its layer (shared_ptr), the layer holds the shard
// set it came from (its spec and layout live there), so nothing a Python
// object can still reach is ever freed, whatever the order in which objects
// are dropped or closed. The layer's bytes go back to its stream's budget
// when the last view of it is gone.
//
// The GIL is released whenever the worker library may block: waiting for a
// layer, connecting, pushing, finishing a step.

#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/gradient_sink.h"
#include "client/layer_stream.h"
#include "client/shard_set.h"
#include "core/dtype.h"
#include "core/log.h"
#include "wire/grpc_status.h"

namespace layercast::python {
namespace {

namespace py = pybind11;

// layercast.Error, created in the module init.
PyObject* g_error = nullptr;

[[noreturn]] void Raise(const absl::Status& status) {
  py::object error = py::reinterpret_borrow<py::object>(g_error);
  py::object instance =
      error(std::string(status.message()), std::string(absl::StatusCodeToString(status.code())));
  PyErr_SetObject(g_error, instance.ptr());
  throw py::error_already_set();
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

std::string DTypeString(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    default:
      return std::string(DTypeName(dtype));
  }
}

DLDataType ToDLDataType(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return {kDLBfloat, 16, 1};
    case DType::kFloat16:
      return {kDLFloat, 16, 1};
    default:
      return {kDLFloat, 32, 1};
  }
}

// What a Python ShardSet holds: the connection, and the gradient sinks made
// for it (one per worker index). Shared with every layer gathered from it.
struct Connection {
  std::unique_ptr<client::ShardSet> set;
  absl::Mutex mu;
  std::map<uint32_t, std::unique_ptr<client::GradientSink>> sinks ABSL_GUARDED_BY(mu);
  ~Connection() {
    // Sinks finish their pushes before the set they push through goes.
    absl::MutexLock lock(&mu);
    sinks.clear();
  }
};

// A gathered layer and what keeps its spec and layout alive.
struct HeldLayer {
  std::shared_ptr<Connection> connection;
  client::Layer layer;
};

// One tensor of a layer, exported through DLPack.
class TensorView {
 public:
  TensorView(std::shared_ptr<HeldLayer> held, size_t index)
      : held_(std::move(held)), index_(index) {}

  client::Layer::TensorView view() const { return held_->layer.tensor(index_); }
  std::string name() const { return std::string(view().name); }
  std::vector<int64_t> shape() const {
    const auto shape = view().shape;
    return {shape.begin(), shape.end()};
  }
  std::string dtype() const { return DTypeString(view().dtype); }
  uint64_t nbytes() const { return view().bytes.size(); }
  uintptr_t data_ptr() const { return reinterpret_cast<uintptr_t>(view().bytes.data()); }

  // A DLPack capsule ("dltensor") of the tensor: the consumer's tensor
  // aliases the layer's buffer and keeps the layer alive until its deleter.
  py::capsule Export() const {
    struct Context {
      std::shared_ptr<HeldLayer> held;
      std::vector<int64_t> shape;
      DLManagedTensor managed;
    };
    auto context = std::make_unique<Context>();
    context->held = held_;
    context->shape = shape();
    const client::Layer::TensorView tensor = view();
    DLTensor& dl = context->managed.dl_tensor;
    // DLPack has no read-only flag: a consumer may write, and changes only
    // this worker's copy of the layer.
    dl.data = const_cast<uint8_t*>(tensor.bytes.data());
    dl.device = {kDLCPU, 0};
    dl.ndim = static_cast<int32_t>(context->shape.size());
    dl.dtype = ToDLDataType(tensor.dtype);
    dl.shape = context->shape.data();
    dl.strides = nullptr;  // compact, row-major
    dl.byte_offset = 0;
    context->managed.manager_ctx = context.get();
    context->managed.deleter = [](DLManagedTensor* self) {
      delete static_cast<Context*>(self->manager_ctx);
    };
    DLManagedTensor* managed = &context.release()->managed;
    // A capsule never consumed (still named "dltensor") frees its tensor.
    return py::capsule(managed, "dltensor", [](PyObject* capsule) {
      if (PyCapsule_IsValid(capsule, "dltensor")) {
        auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
        tensor->deleter(tensor);
      }
    });
  }

 private:
  std::shared_ptr<HeldLayer> held_;
  size_t index_;
};

class PyLayer {
 public:
  explicit PyLayer(std::shared_ptr<HeldLayer> held) : held_(std::move(held)) {}
  uint32_t index() const { return held_->layer.index(); }
  std::string name() const { return held_->layer.name(); }
  uint64_t version() const { return held_->layer.version(); }
  uint64_t nbytes() const { return held_->layer.bytes().size(); }
  uintptr_t data_ptr() const { return reinterpret_cast<uintptr_t>(held_->layer.bytes().data()); }
  std::vector<std::string> names() const {
    std::vector<std::string> names;
    for (size_t i = 0; i < held_->layer.num_tensors(); ++i) {
      names.emplace_back(held_->layer.tensor(i).name);
    }
    return names;
  }
  TensorView tensor(const std::string& name) const {
    for (size_t i = 0; i < held_->layer.num_tensors(); ++i) {
      if (held_->layer.tensor(i).name == name) return TensorView(held_, i);
    }
    throw py::key_error(absl::StrCat("layer ", held_->layer.index(), " (", held_->layer.name(),
                                     ") has no tensor ", name));
  }

 private:
  std::shared_ptr<HeldLayer> held_;
};

class PyStream {
 public:
  PyStream(std::shared_ptr<Connection> connection, std::unique_ptr<client::LayerStream> stream)
      : connection_(std::move(connection)), stream_(std::move(stream)) {}

  // The next layer; StopIteration after the last.
  PyLayer Next() {
    if (stream_ == nullptr) throw py::stop_iteration();
    absl::StatusOr<client::Layer> layer;
    {
      py::gil_scoped_release release;
      layer = stream_->Next();
    }
    if (layer.status().code() == absl::StatusCode::kOutOfRange) throw py::stop_iteration();
    if (!layer.ok()) Raise(layer.status());
    return PyLayer(std::make_shared<HeldLayer>(HeldLayer{connection_, *std::move(layer)}));
  }

  py::dict Stats() const {
    const client::LayerStreamStats stats = stream_ ? stream_->stats() : client::LayerStreamStats{};
    py::dict out;
    out["layers"] = stats.layers;
    out["hits"] = stats.hits;
    out["misses"] = stats.misses;
    out["wait_seconds"] = stats.wait_seconds;
    out["peak_bytes"] = stats.peak_bytes;
    out["budget_bytes"] = stats.budget_bytes;
    return out;
  }

  // Cancels what is in flight; layers handed out stay valid.
  void Close() {
    py::gil_scoped_release release;
    stream_.reset();
  }

 private:
  std::shared_ptr<Connection> connection_;
  std::unique_ptr<client::LayerStream> stream_;
};

// The pending result of one push_gradients.
class PyPush {
 public:
  explicit PyPush(std::shared_future<absl::StatusOr<client::PushResult>> future)
      : future_(std::move(future)) {}
  bool done() const {
    return future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  py::dict Result() const {
    {
      py::gil_scoped_release release;
      future_.wait();
    }
    const client::PushResult result = ValueOrRaise(future_.get());
    py::dict out;
    out["layer"] = result.layer;
    out["step"] = result.step;
    out["layer_version"] = result.layer_version;
    out["applied"] = result.applied;
    return out;
  }

 private:
  std::shared_future<absl::StatusOr<client::PushResult>> future_;
};

// Copies one gradient tensor, given through DLPack, into its place in the
// assembled layout. TypeError/ValueError naming what was expected.
void CopyGradient(const py::handle& tensor, const TensorSpec& spec, const AssembledTensor& placed,
                  uint8_t* destination) {
  if (!py::hasattr(tensor, "__dlpack__")) {
    throw py::type_error(absl::StrCat("the gradient of ", spec.name,
                                      " is not a tensor: pass a torch.Tensor (or any object with "
                                      "__dlpack__)"));
  }
  py::capsule capsule = tensor.attr("__dlpack__")();
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  // Consumed: this function calls the deleter, not the capsule.
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  std::unique_ptr<DLManagedTensor, void (*)(DLManagedTensor*)> owner(managed,
                                                                     [](DLManagedTensor* t) {
                                                                       if (t->deleter != nullptr)
                                                                         t->deleter(t);
                                                                     });
  const DLTensor& dl = managed->dl_tensor;
  const DLDataType want = ToDLDataType(placed.compute_dtype);
  if (dl.device.device_type != kDLCPU) {
    throw py::value_error(
        absl::StrCat("the gradient of ", spec.name, " is not in host memory: move it with .cpu()"));
  }
  if (dl.dtype.code != want.code || dl.dtype.bits != want.bits || dl.dtype.lanes != 1) {
    throw py::type_error(absl::StrCat("the gradient of ", spec.name, " must be ",
                                      DTypeString(placed.compute_dtype),
                                      ", the tensor's compute dtype: convert it with .to()"));
  }
  std::vector<int64_t> shape(dl.shape, dl.shape + dl.ndim);
  if (shape != spec.shape) {
    throw py::value_error(absl::StrCat("the gradient of ", spec.name, " has shape [",
                                       absl::StrJoin(shape, ", "), "], the tensor [",
                                       absl::StrJoin(spec.shape, ", "), "]"));
  }
  if (dl.strides != nullptr) {
    int64_t expected = 1;
    for (int32_t d = dl.ndim; d-- > 0;) {
      if (dl.shape[d] != 1 && dl.strides[d] != expected) {
        throw py::value_error(
            absl::StrCat("the gradient of ", spec.name, " is not contiguous: pass .contiguous()"));
      }
      expected *= dl.shape[d];
    }
  }
  const uint64_t bytes = placed.num_elements * DTypeSize(placed.compute_dtype);
  std::memcpy(destination, static_cast<const uint8_t*>(dl.data) + dl.byte_offset, bytes);
}

class PyShardSet {
 public:
  explicit PyShardSet(std::shared_ptr<Connection> connection)
      : connection_(std::move(connection)) {}

  const Connection& connection() const {
    if (connection_ == nullptr) {
      Raise(absl::FailedPreconditionError(
          "this shard set is closed: connect again (layercast.connect) to use the shards"));
    }
    return *connection_;
  }

  py::dict Manifest() const {
    const client::ShardSet& set = *connection().set;
    const client::ShardSetView& view = set.view();
    py::list layers;
    for (uint32_t l = 0; l < view.model.layers.size(); ++l) {
      const LayerSpec& spec = view.model.layers[l];
      py::list tensors;
      for (uint32_t t = 0; t < spec.tensors.size(); ++t) {
        py::dict tensor;
        tensor["name"] = spec.tensors[t].name;
        tensor["shape"] = spec.tensors[t].shape;
        tensor["dtype"] = DTypeString(view.layouts[l].tensors()[t].compute_dtype);
        tensor["param_dtype"] = "float32";
        tensors.append(tensor);
      }
      py::dict layer;
      layer["index"] = l;
      layer["name"] = spec.name;
      layer["nbytes"] = view.layouts[l].total_bytes();
      layer["tensors"] = tensors;
      layers.append(layer);
    }
    uint64_t version = UINT64_MAX;
    for (const layercast::v1::Manifest& manifest : set.manifests()) {
      version = std::min<uint64_t>(version, manifest.version());
    }
    py::dict out;
    out["model_id"] = view.model.model_id;
    out["num_shards"] = view.num_shards;
    out["policy"] = view.policy.ToString();
    out["version"] = version;
    out["layers"] = layers;
    return out;
  }

  PyStream Stream(std::vector<uint32_t> order, uint64_t budget_bytes,
                  std::optional<uint32_t> lookahead, uint64_t min_version, double timeout) {
    const Connection& connection = this->connection();
    client::LayerStreamOptions options;
    options.order = std::move(order);
    options.budget_bytes = budget_bytes;
    if (lookahead) options.max_lookahead = *lookahead;
    options.gather.min_version = min_version;
    options.gather.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
    auto stream = ValueOrRaise(client::LayerStream::Create(*connection.set, std::move(options)));
    return PyStream(connection_, std::move(stream));
  }

  PyPush PushGradients(uint64_t step, uint32_t worker, uint32_t layer, const py::dict& gradients) {
    Connection& connection = const_cast<Connection&>(this->connection());
    const client::ShardSetView& view = connection.set->view();
    if (layer >= view.layouts.size()) {
      Raise(absl::NotFoundError(
          absl::StrCat("there is no layer ", layer, "; the model has ", view.layouts.size())));
    }
    const LayerSpec& spec = view.model.layers[layer];
    const AssembledLayout& layout = view.layouts[layer];
    if (gradients.size() != spec.tensors.size()) {
      std::vector<std::string> names;
      for (const TensorSpec& tensor : spec.tensors) names.push_back(tensor.name);
      throw py::value_error(absl::StrCat("layer ", layer, " has ", spec.tensors.size(),
                                         " tensors (", absl::StrJoin(names, ", "), "); ",
                                         gradients.size(), " gradients were given"));
    }
    client::LayerBuffer buffer = ValueOrRaise(client::LayerBuffer::Allocate(layout.total_bytes()));
    std::memset(buffer.data(), 0, buffer.size());  // padding goes out as zeros
    for (uint32_t t = 0; t < spec.tensors.size(); ++t) {
      const py::str name(spec.tensors[t].name);
      if (!gradients.contains(name)) {
        throw py::key_error(
            absl::StrCat("no gradient for ", spec.tensors[t].name, " of layer ", layer));
      }
      const AssembledTensor& placed = layout.tensors()[t];
      CopyGradient(gradients[name], spec.tensors[t], placed, buffer.data() + placed.byte_offset);
    }
    client::GradientSink* sink = nullptr;
    {
      absl::MutexLock lock(&connection.mu);
      auto& slot = connection.sinks[worker];
      if (slot == nullptr) {
        slot = ValueOrRaise(client::GradientSink::Create(*connection.set, {.worker = worker}));
      }
      sink = slot.get();
    }
    absl::StatusOr<std::shared_future<absl::StatusOr<client::PushResult>>> future;
    {
      py::gil_scoped_release release;
      future = sink->Push(layer, step, std::move(buffer));
    }
    return PyPush(ValueOrRaise(std::move(future)));
  }

  py::dict FinishStep(uint64_t step, uint32_t worker) {
    Connection& connection = const_cast<Connection&>(this->connection());
    client::GradientSink* sink = nullptr;
    {
      absl::MutexLock lock(&connection.mu);
      auto found = connection.sinks.find(worker);
      if (found == connection.sinks.end()) {
        Raise(absl::FailedPreconditionError(
            absl::StrCat("worker ", worker,
                         " pushed no gradients through this shard set: push every layer's "
                         "gradient (push_gradients) before finishing the step")));
      }
      sink = found->second.get();
    }
    absl::StatusOr<client::GradientSink::StepEnd> end;
    {
      py::gil_scoped_release release;
      end = sink->FinishStep(step);
    }
    const client::GradientSink::StepEnd result = ValueOrRaise(std::move(end));
    py::dict out;
    out["clipped"] = result.clipped;
    out["total_norm"] = result.total_norm;
    out["scale"] = result.scale;
    return out;
  }

  // Drops this object's hold on the connection: gradients pushed are
  // finished first; layers and views still held keep what they need.
  void Close() {
    std::shared_ptr<Connection> connection = std::move(connection_);
    if (connection == nullptr) return;
    py::gil_scoped_release release;
    {
      absl::MutexLock lock(&connection->mu);
      for (auto& [worker, sink] : connection->sinks) sink->Flush().IgnoreError();
    }
    connection.reset();
  }

  bool closed() const { return connection_ == nullptr; }

 private:
  std::shared_ptr<Connection> connection_;
};

std::shared_ptr<grpc::ChannelCredentials> Credentials(const std::optional<py::dict>& tls) {
  if (!tls) return nullptr;
  grpc::SslCredentialsOptions options;
  for (const auto& [key, value] : *tls) {
    const std::string name = py::str(key);
    const std::string pem = py::str(value);
    if (name == "root_certificates") {
      options.pem_root_certs = pem;
    } else if (name == "certificate_chain") {
      options.pem_cert_chain = pem;
    } else if (name == "private_key") {
      options.pem_private_key = pem;
    } else {
      throw py::value_error(
          absl::StrCat("unknown tls key ", name,
                       ": use root_certificates, certificate_chain and private_key (PEM strings)"));
    }
  }
  return grpc::SslCredentials(options);
}

PyShardSet Connect(std::vector<std::string> addresses, std::optional<py::dict> tls,
                   double timeout) {
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
  options.credentials = Credentials(tls);
  absl::StatusOr<std::unique_ptr<client::ShardSet>> set;
  {
    py::gil_scoped_release release;
    set = client::ShardSet::Connect(std::move(addresses), std::move(options));
  }
  auto connection = std::make_shared<Connection>();
  connection->set = ValueOrRaise(std::move(set));
  return PyShardSet(std::move(connection));
}

}  // namespace

// gRPC reads each message into fresh heap buffers of up to a few MiB. glibc
// keeps freed buffers of that size for reuse once its adaptive thresholds
// have risen to them, which they do in a fresh C++ worker but (measured)
// not in a Python interpreter, where every read then faulted its buffer in
// page by page: 20x the page faults and 0.77x the C++ worker's gather
// throughput. Setting the values the thresholds rise to (32 MiB mmap, twice
// that before trimming) gives the interpreter the worker's behaviour. Left
// alone when the user set either through glibc's environment variables.
void TuneMalloc() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    return;
  }
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

PYBIND11_MODULE(_layercast, module) {
  module.doc() = "layercast's native module; use the layercast package.";
  TuneMalloc();
  g_error = PyErr_NewExceptionWithDoc(
      "layercast.Error",
      "An error from the shards or the worker library. args: (message, code), code the gRPC "
      "status name, e.g. 'NOT_FOUND'.",
      PyExc_RuntimeError, nullptr);
  module.attr("Error") = py::handle(g_error);

  py::class_<TensorView>(module, "Tensor")
      .def_property_readonly("name", &TensorView::name)
      .def_property_readonly("shape", &TensorView::shape)
      .def_property_readonly("dtype", &TensorView::dtype)
      .def_property_readonly("nbytes", &TensorView::nbytes)
      .def_property_readonly("data_ptr", &TensorView::data_ptr)
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
           py::arg("lookahead") = py::none(), py::arg("min_version") = 0, py::arg("timeout") = 60.0)
      .def("push_gradients", &PyShardSet::PushGradients, py::arg("step"), py::arg("worker"),
           py::arg("layer"), py::arg("gradients"))
      .def("finish_step", &PyShardSet::FinishStep, py::arg("step"), py::arg("worker"))
      .def("close", &PyShardSet::Close);

  module.def("connect", &Connect, py::arg("shards"), py::arg("tls") = py::none(),
             py::arg("timeout") = 30.0);
}

}  // namespace layercast::python
