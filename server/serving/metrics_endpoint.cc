#include "server/serving/metrics_endpoint.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"

namespace layercast::server {
namespace {

// Connects to host:port (a wildcard host means this machine) and closes the
// connection, ignoring every failure: a nudge, nothing more. The host is the
// one the endpoint bound, so it is local and answers at once.
void Nudge(const std::string& host, int port) {
  std::string name = host;
  if (name.size() > 1 && name.front() == '[') name = name.substr(1, name.size() - 2);
  if (name.empty() || name == "0.0.0.0") name = "127.0.0.1";
  if (name == "::") name = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(name.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen) {
  auto endpoint = std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint());
  endpoint->host_ = listen.substr(0, listen.rfind(':'));
  // prometheus-cpp reports a bind failure by throwing; this is its edge.
  try {
    endpoint->exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/1);
  } catch (const std::exception& error) {
    // civetweb says only "null context when constructing CivetServer".
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", listen,
        ": the address is in use or not local; choose another --metrics-listen (port 0 picks a "
        "free one) (prometheus-cpp: ",
        error.what(), ")"));
  }
  const std::vector<int> ports = endpoint->exposer_->GetListeningPorts();
  endpoint->port_ = ports.empty() ? 0 : ports[0];
  return endpoint;
}

void MetricsEndpoint::Register(const std::weak_ptr<prometheus::Collectable>& collectable) {
  exposer_->RegisterCollectable(collectable);
}

MetricsEndpoint::~MetricsEndpoint() {
  // Nudges civetweb's accept loop until its stop (in the Exposer's
  // destructor) has returned; each connection wakes its poll at once. A
  // thread only for the length of this destructor, not a shard's scheduler:
  // the endpoint serves relays too, and the nudges must go on in real time
  // while a test's clock stands still.
  std::atomic<bool> stopped{false};
  std::thread nudger;
  try {
    nudger = std::thread([this, &stopped] {
      for (int i = 0; i < 500 && !stopped.load(); ++i) {  // 10 s at most
        Nudge(host_, port_);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
  } catch (const std::system_error&) {
    // No thread to spare: the Exposer stops on its own, within 2 s.
  }
  exposer_.reset();
  stopped.store(true);
  if (nudger.joinable()) nudger.join();
}

}  // namespace layercast::server
