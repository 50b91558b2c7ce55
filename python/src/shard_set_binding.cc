#include "python/src/shard_set_binding.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/bearer_token.h"
#include "client/model_export.h"
#include "python/src/errors.h"

namespace layercast::python {
namespace {

namespace py = pybind11;

std::chrono::milliseconds Milliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

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

}  // namespace

uintptr_t PyLayer::data_ptr() const { return reinterpret_cast<uintptr_t>(held_->bytes().data()); }

std::vector<std::string> PyLayer::names() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < held_->num_tensors(); ++i) {
    names.emplace_back(held_->tensor(i).name);
  }
  return names;
}

TensorView PyLayer::tensor(const std::string& name) const {
  for (size_t i = 0; i < held_->num_tensors(); ++i) {
    if (held_->tensor(i).name == name) return TensorView(held_, i);
  }
  throw py::key_error(
      absl::StrCat("layer ", held_->index(), " (", held_->name(), ") has no tensor ", name));
}

PyLayer PyStream::Next() {
  const std::shared_ptr<client::LayerStream> stream = stream_;
  if (stream == nullptr) throw py::stop_iteration();
  absl::StatusOr<client::Layer> layer;
  {
    py::gil_scoped_release release;
    layer = stream->Next();
  }
  if (layer.status().code() == absl::StatusCode::kOutOfRange) throw py::stop_iteration();
  if (!layer.ok()) Raise(layer.status());
  auto held = std::make_shared<HeldLayer>(HeldLayer{connection_, *std::move(layer)});
  return PyLayer(std::shared_ptr<const client::Layer>(held, &held->layer));
}

py::dict PyStream::Stats() const {
  const client::LayerStreamStats stats = stream_ ? stream_->stats() : client::LayerStreamStats{};
  py::dict out;
  out["layers"] = stats.layers;
  out["hits"] = stats.hits;
  out["misses"] = stats.misses;
  out["landed"] = stats.landed;
  out["wait_seconds"] = stats.wait_seconds;
  out["peak_bytes"] = stats.peak_bytes;
  out["budget_bytes"] = stats.budget_bytes;
  return out;
}

void PyStream::Close() {
  std::shared_ptr<client::LayerStream> stream = std::move(stream_);
  py::gil_scoped_release release;  // the stream waits for its gather in flight
  stream.reset();
}

bool PyPush::done() const {
  return future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

py::dict PyPush::Result() const {
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

std::shared_ptr<Connection> PyShardSet::Held() const {
  if (connection_ == nullptr) {
    Raise(absl::FailedPreconditionError(
        "this shard set is closed: connect again (layercast.connect) to use the shards"));
  }
  return connection_;
}

py::dict PyShardSet::Manifest() const {
  const std::shared_ptr<Connection> connection = Held();
  const client::ShardSet& set = *connection->set;
  const wire::ShardSetView& view = set.view();
  // What the shards serve, as their manifest lists it: a relay started with
  // --dtype lists every tensor in the dtype it holds (held_dtype), laid out
  // as a pull in it, while the view stays the policy's. The view is shard
  // 0's, and CheckManifest has checked its tensors and sizes against it.
  const layercast::v1::Manifest& served = set.manifests()[0];
  py::list layers;
  for (uint32_t l = 0; l < view.model.layers.size(); ++l) {
    const LayerSpec& spec = view.model.layers[l];
    const layercast::v1::Layer& listed = served.layers(static_cast<int>(l));
    py::list tensors;
    for (uint32_t t = 0; t < spec.tensors.size(); ++t) {
      py::dict tensor;
      tensor["name"] = spec.tensors[t].name;
      tensor["shape"] = spec.tensors[t].shape;
      tensor["dtype"] =
          DTypeString(static_cast<DType>(listed.tensors(static_cast<int>(t)).compute_dtype()));
      tensor["policy_dtype"] = DTypeString(view.layouts[l].tensors()[t].compute_dtype);
      tensor["param_dtype"] = "float32";
      tensor["grad_dtype"] = DTypeString(view.gradient_layouts[l].tensors()[t].compute_dtype);
      tensors.append(tensor);
    }
    py::dict layer;
    layer["index"] = l;
    layer["name"] = spec.name;
    // The layer as served (held), which CheckManifest has checked.
    layer["nbytes"] = listed.assembled_bytes();
    layer["grad_nbytes"] = view.gradient_layouts[l].total_bytes();
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
  // The dtype a relay holds every tensor in (None: the policy's dtypes).
  out["held_dtype"] =
      served.has_held_dtype()
          ? py::object(py::str(DTypeString(static_cast<DType>(served.held_dtype()))))
          : py::object(py::none());
  out["version"] = version;
  // What a training set expects of its workers (0 and "" when read-only).
  out["data_parallel_workers"] = served.data_parallel_workers();
  out["optimizer"] = served.optimizer();
  out["layers"] = layers;
  return out;
}

PyStream PyShardSet::Stream(std::vector<uint32_t> order, uint64_t budget_bytes,
                            std::optional<uint32_t> lookahead, uint64_t min_version,
                            std::optional<uint64_t> version, double timeout) {
  std::shared_ptr<Connection> connection = Held();
  client::LayerStreamOptions options;
  options.order = std::move(order);
  options.budget_bytes = budget_bytes;
  if (lookahead) options.max_lookahead = *lookahead;
  options.gather.min_version = min_version;
  options.gather.exact_version = version;
  options.gather.timeout = Milliseconds(timeout);
  auto stream = ValueOrRaise(client::LayerStream::Create(*connection->set, std::move(options)));
  return PyStream(std::move(connection), std::move(stream));
}

py::dict PyShardSet::Export(const std::string& path, const std::string& dtype,
                            std::optional<uint64_t> version, uint64_t max_file_bytes,
                            double timeout) const {
  std::shared_ptr<Connection> connection = Held();
  client::ExportOptions options;
  options.path = path;
  options.dtype = ValueOrRaise(DTypeFromName(dtype));
  options.version = version;
  options.max_file_bytes = max_file_bytes;
  options.layer_timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
  absl::StatusOr<client::ExportResult> result;
  {
    py::gil_scoped_release unlocked;
    result = client::ExportModel(*connection->set, options);
  }
  if (!result.ok()) Raise(result.status());
  py::dict out;
  out["version"] = result->version;
  out["bytes"] = result->bytes;
  out["tensors"] = result->tensors;
  out["files"] = result->files;
  return out;
}

uint64_t PyShardSet::Version() const {
  std::shared_ptr<Connection> connection = Held();
  absl::StatusOr<uint64_t> version;
  {
    py::gil_scoped_release unlocked;
    version = connection->set->CurrentVersion();
  }
  return ValueOrRaise(std::move(version));
}

PyPush PyShardSet::PushGradients(uint64_t step, uint32_t worker, uint32_t layer,
                                 const py::dict& gradients) {
  const std::shared_ptr<Connection> connection = Held();
  const wire::ShardSetView& view = connection->set->view();
  if (layer >= view.layouts.size()) {
    Raise(absl::NotFoundError(
        absl::StrCat("there is no layer ", layer, "; the model has ", view.layouts.size())));
  }
  const LayerSpec& spec = view.model.layers[layer];
  const AssembledLayout& layout = view.gradient_layouts[layer];
  if (gradients.size() != spec.tensors.size()) {
    std::vector<std::string> names;
    for (const TensorSpec& tensor : spec.tensors) names.push_back(tensor.name);
    throw py::value_error(absl::StrCat("layer ", layer, " has ", spec.tensors.size(), " tensors (",
                                       absl::StrJoin(names, ", "), "); ", gradients.size(),
                                       " gradients were given"));
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
    ImportGradient(gradients[name], spec.tensors[t], placed, buffer.data() + placed.byte_offset);
  }
  client::GradientSink* sink = nullptr;
  {
    absl::MutexLock lock(&connection->mu);
    std::unique_ptr<client::GradientSink>& slot = connection->sinks[worker];
    if (slot == nullptr) {
      slot = ValueOrRaise(
          client::GradientSink::Create(*connection->set, {.worker = worker,
                                                          .worker_token = connection->worker_token,
                                                          .insecure = connection->insecure}));
    }
    sink = slot.get();  // lives as long as `connection`, held here
  }
  absl::StatusOr<std::shared_future<absl::StatusOr<client::PushResult>>> future;
  {
    py::gil_scoped_release release;  // Push blocks while the sink's byte budget is full
    future = sink->Push(layer, step, std::move(buffer));
  }
  return PyPush(ValueOrRaise(std::move(future)));
}

py::dict PyShardSet::FinishStep(uint64_t step, uint32_t worker) {
  const std::shared_ptr<Connection> connection = Held();
  client::GradientSink* sink = nullptr;
  {
    absl::MutexLock lock(&connection->mu);
    auto found = connection->sinks.find(worker);
    if (found == connection->sinks.end()) {
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

void PyShardSet::Close() {
  std::shared_ptr<Connection> connection = std::move(connection_);
  if (connection == nullptr) return;
  py::gil_scoped_release release;
  absl::MutexLock lock(&connection->mu);
  for (auto& [worker, sink] : connection->sinks) sink->Flush().IgnoreError();
}

PyShardSet Connect(std::vector<std::string> addresses, std::optional<py::dict> tls, double timeout,
                   const std::string& worker_token, bool insecure) {
  std::string token;
  if (!worker_token.empty()) {
    token = ValueOrRaise(client::CleanBearerToken(worker_token, "worker_token"));
    if (absl::Status plain =
            client::CheckTokenTransport(tls.has_value(), insecure, "insecure=True");
        !plain.ok()) {
      Raise(plain);
    }
  }
  client::ShardSetOptions options;
  options.connect_timeout = Milliseconds(timeout);
  options.shards_name = "connect()'s shards";
  options.connect_timeout_name = "connect()'s timeout, in seconds";
  options.credentials = Credentials(tls);
  absl::StatusOr<std::unique_ptr<client::ShardSet>> set;
  {
    py::gil_scoped_release release;
    set = client::ShardSet::Connect(std::move(addresses), std::move(options));
  }
  auto connection = std::make_shared<Connection>();
  connection->set = ValueOrRaise(std::move(set));
  connection->worker_token = std::move(token);
  connection->insecure = insecure;
  return PyShardSet(std::move(connection));
}

}  // namespace layercast::python
