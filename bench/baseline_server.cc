#include "bench/baseline_server.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/shard_set.h"
#include "core/crc32c.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "wire/chunk_encoder.h"

namespace layercast::bench {
namespace {

// As layercast-shard's default --chunk-bytes.
constexpr uint64_t kChunkBytes = 1 << 20;

// Moves all `size` bytes through `io` (read or write on a pipe), across
// short transfers and EINTR; false at end of file or on an error.
template <typename Io, typename Byte>
bool Transfer(Io io, int fd, Byte* p, size_t size) {
  while (size > 0) {
    const ssize_t n = io(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool WriteAll(int fd, const void* data, size_t size) {
  return Transfer(::write, fd, static_cast<const char*>(data), size);
}

bool ReadAll(int fd, void* data, size_t size) {
  return Transfer(::read, fd, static_cast<char*>(data), size);
}

// Writes one layer's pre-encoded chunks in order, one write in flight, as
// FetchLayerReactor does, but with nothing to cast.
class PremadeReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  PremadeReactor(const std::vector<grpc::ByteBuffer>* chunks, size_t first)
      : chunks_(chunks), next_(first) {
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (next_ == chunks_->size()) {
      Finish(grpc::Status::OK);
      return;
    }
    chunk_ = (*chunks_)[next_++];  // a reference to the same slices, no copy
    StartWrite(&chunk_);
  }
  const std::vector<grpc::ByteBuffer>* chunks_;
  size_t next_;
  grpc::ByteBuffer chunk_;
};

class BaselineService final : public layercast::v1::ShardService::WithCallbackMethod_GetManifest<
                                  layercast::v1::ShardService::WithRawCallbackMethod_FetchLayer<
                                      layercast::v1::ShardService::Service>> {
 public:
  // Encodes every chunk shard manifest.shard_index() would send, once.
  explicit BaselineService(layercast::v1::Manifest manifest) : manifest_(std::move(manifest)) {
    const uint32_t shard = manifest_.shard_index(), n = manifest_.num_shards();
    for (const layercast::v1::Layer& layer : manifest_.layers()) {
      std::vector<grpc::ByteBuffer>& chunks = layers_.emplace_back();
      std::vector<uint64_t>& starts = starts_.emplace_back();
      for (int t = 0; t < layer.tensors_size(); ++t) {
        const layercast::v1::Tensor& tensor = layer.tensors(t);
        const ElementRange owned = ShardElementRange(tensor.num_elements(), shard, n);
        const size_t size = DTypeSize(static_cast<DType>(tensor.compute_dtype()));
        const uint64_t per_chunk = std::max<uint64_t>(1, kChunkBytes / size);
        for (uint64_t e = owned.begin; e < owned.end; e += per_chunk) {
          const uint64_t count = std::min(per_chunk, owned.end - e);
          grpc::Slice slice(count * size);
          auto* data = const_cast<uint8_t*>(slice.begin());
          for (size_t i = 0; i < slice.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + e);
          starts.push_back(tensor.byte_offset() + e * size);
          chunks.push_back(wire::EncodeLayerChunk(static_cast<uint32_t>(t), e, manifest_.version(),
                                                  Crc32c(data, slice.size()), slice));
        }
      }
    }
  }

  grpc::ServerUnaryReactor* GetManifest(grpc::CallbackServerContext* context,
                                        const layercast::v1::GetManifestRequest*,
                                        layercast::v1::Manifest* response) override {
    *response = manifest_;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchLayer(grpc::CallbackServerContext*,
                                                         const grpc::ByteBuffer* raw) override {
    std::vector<grpc::Slice> slices;
    std::string bytes;
    layercast::v1::FetchLayerRequest request;
    if (raw->Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices)
        bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    // The worker asks shard i > 0 for the range from its first owned byte to
    // the end of the layer: start at that chunk.
    size_t first = 0;
    bool ok = request.ParseFromString(bytes) && request.layer() < layers_.size();
    if (ok) {
      const std::vector<uint64_t>& starts = starts_[request.layer()];
      first = static_cast<size_t>(
          std::lower_bound(starts.begin(), starts.end(), request.range_begin()) - starts.begin());
      ok = (request.range_begin() == 0 ||
            (first < starts.size() && starts[first] == request.range_begin())) &&
           (request.range_end() == 0 ||
            request.range_end() ==
                manifest_.layers(static_cast<int>(request.layer())).assembled_bytes());
    }
    if (!ok) {
      struct Refuse final : grpc::ServerWriteReactor<grpc::ByteBuffer> {
        Refuse() {
          Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "baseline: only a whole shard's part of a layer"));
        }
        void OnDone() override { delete this; }
      };
      return new Refuse();
    }
    return new PremadeReactor(&layers_[request.layer()], first);
  }

 private:
  const layercast::v1::Manifest manifest_;
  std::vector<std::vector<grpc::ByteBuffer>> layers_;
  std::vector<std::vector<uint64_t>> starts_;  // each chunk's assembled byte offset
};

// The forked child: reads its manifest from `in`, serves it, writes its port
// to `out`, and serves until `in` reaches end of file. Never returns.
[[noreturn]] void BaselineChild(int in, int out) {
  uint64_t size = 0;
  std::string bytes;
  layercast::v1::Manifest manifest;
  if (!ReadAll(in, &size, sizeof size)) _exit(0);  // parent ended without using us
  bytes.resize(size);
  if (!ReadAll(in, bytes.data(), size) || !manifest.ParseFromString(bytes)) _exit(2);
  int port = 0;
  {
    BaselineService service(std::move(manifest));
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    const int32_t reply = server ? port : 0;
    WriteAll(out, &reply, sizeof reply);
    if (!server) _exit(3);
    char c;
    while (read(in, &c, 1) > 0) {
    }
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  _exit(0);
}

}  // namespace

std::vector<BaselineProcess> ForkBaselines(uint32_t n) {
  std::vector<BaselineProcess> children;
  for (uint32_t i = 0; i < n; ++i) {
    int down[2], up[2];
    if (pipe2(down, O_CLOEXEC) != 0 || pipe2(up, O_CLOEXEC) != 0) break;
    const pid_t pid = fork();
    if (pid == 0) {
      close(down[1]);
      close(up[0]);
      // Pipes to earlier children must not be held open by this one.
      for (const BaselineProcess& c : children) {
        close(c.to_child);
        close(c.from_child);
      }
      BaselineChild(down[0], up[1]);
    }
    close(down[0]);
    close(up[1]);
    children.push_back({pid, down[1], up[0]});
  }
  return children;
}

void StopBaselines(std::vector<BaselineProcess>& children) {
  for (BaselineProcess& c : children) {
    close(c.to_child);
    close(c.from_child);
  }
  for (BaselineProcess& c : children) waitpid(c.pid, nullptr, 0);
  children.clear();
}

absl::StatusOr<BaselineSet> ServeBaselines(const std::vector<BaselineProcess>& baselines,
                                           const std::vector<std::string>& addresses) {
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::minutes(2);
  auto set = client::ShardSet::Connect(addresses, connect);
  if (!set.ok()) return set.status();
  BaselineSet result;
  for (const auto& layout : (*set)->view().layouts) result.assembled += layout.total_bytes();
  result.num_layers = (*set)->view().layouts.size();
  for (size_t i = 0; i < baselines.size(); ++i) {
    const std::string bytes = (*set)->manifests()[i].SerializeAsString();
    const uint64_t size = bytes.size();
    int32_t port = 0;
    if (!WriteAll(baselines[i].to_child, &size, sizeof size) ||
        !WriteAll(baselines[i].to_child, bytes.data(), size) ||
        !ReadAll(baselines[i].from_child, &port, sizeof port) || port == 0) {
      return absl::InternalError(absl::StrCat("baseline server ", i, " did not start"));
    }
    result.addresses.push_back(absl::StrCat("127.0.0.1:", port));
    result.pids.push_back(baselines[i].pid);
  }
  return result;
}

}  // namespace layercast::bench
