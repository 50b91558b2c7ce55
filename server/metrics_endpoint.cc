#include "server/metrics_endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace layercast::server {
namespace {

// Connects to and closes host:port (IPv4 or IPv6 literal, or any address for
// a wildcard host), ignoring every failure: a nudge, nothing more.
void Nudge(const std::string& host, int port) {
  sockaddr_in6 address6{};
  sockaddr_in address4{};
  const std::string target = host.empty() || host == "0.0.0.0" ? "127.0.0.1"
                             : host == "[::]" || host == "::"  ? "::1"
                                                               : host;
  const std::string bare = target.front() == '[' ? target.substr(1, target.size() - 2) : target;
  if (inet_pton(AF_INET6, bare.c_str(), &address6.sin6_addr) == 1) {
    address6.sin6_family = AF_INET6;
    address6.sin6_port = htons(static_cast<uint16_t>(port));
    const int fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd < 0) return;
    (void)connect(fd, reinterpret_cast<sockaddr*>(&address6), sizeof(address6));
    close(fd);
  } else if (inet_pton(AF_INET, bare.c_str(), &address4.sin_addr) == 1) {
    address4.sin_family = AF_INET;
    address4.sin_port = htons(static_cast<uint16_t>(port));
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return;
    (void)connect(fd, reinterpret_cast<sockaddr*>(&address4), sizeof(address4));
    close(fd);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen) {
  auto endpoint = std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint());
  endpoint->host_ = listen.substr(0, listen.rfind(':'));
  // prometheus-cpp reports a bind failure by throwing; this is its edge.
  try {
    endpoint->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", listen, "num_threads", "2", "enable_keep_alive", "no"});
  } catch (const std::exception& error) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ",
                                               error.what(), "; choose another --metrics-listen"));
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
  // destructor) has returned; each connection wakes its poll at once.
  std::atomic<bool> stopped{false};
  std::thread nudger([this, &stopped] {
    for (int i = 0; i < 500 && !stopped.load(); ++i) {  // 10 s at most
      Nudge(host_, port_);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer_.reset();
  stopped.store(true);
  nudger.join();
}

}  // namespace layercast::server
