#include "tests/integration/shard_fixture.h"

#include <fstream>

#include <sys/wait.h>

#include <algorithm>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <regex>
#include <sstream>
#include <thread>

namespace layercast::testing {

std::string MakeTempDir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("layercast-" + std::to_string(getpid())) /
      (std::string(info->test_suite_name()) + "." + info->name() + "." + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string ScrapeShard(const std::string& log_path) {
  static const std::regex kLine(R"(metrics on 127\.0\.0\.1:(\d+)/metrics)");
  std::ifstream log(log_path);
  std::string port;
  std::smatch match;
  for (std::string line; std::getline(log, line);) {
    if (std::regex_search(line, match, kLine)) port = match[1];
  }
  if (port.empty()) return "";
  boost::asio::ip::tcp::iostream stream;
  stream.expires_after(std::chrono::seconds(5));
  stream.connect("127.0.0.1", port);
  if (!stream) return "";
  stream << "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" << std::flush;
  return std::string(std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>());
}

std::optional<double> ShardMetric(const std::string& log_path, const std::string& name) {
  std::istringstream body(ScrapeShard(log_path));
  std::optional<double> total;
  for (std::string line; std::getline(body, line);) {
    // "NAME VALUE" or "NAME{LABELS} VALUE"; comments start with '#'.
    if (!line.starts_with(name) || line.size() <= name.size()) continue;
    if (line[name.size()] != ' ' && line[name.size()] != '{') continue;
    const size_t space = line.rfind(' ');
    total = total.value_or(0) + std::strtod(line.c_str() + space + 1, nullptr);
  }
  return total;
}

bool AwaitShardMetric(const std::string& log_path, const std::string& name, double value,
                      std::chrono::milliseconds limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < give_up) {
    if (ShardMetric(log_path, name) == value) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

std::unique_ptr<tools::LocalShardSet> StartProcesses(uint32_t n, std::vector<std::string> flags,
                                                     const std::string& log_dir) {
  tools::LocalShardSet::Options options;
  options.shard_binary = ShardBinary();
  options.num_shards = n;
  options.extra_flags = std::move(flags);
  options.log_dir = log_dir;
  auto set = tools::LocalShardSet::Start(options);
  EXPECT_TRUE(set.ok()) << set.status();
  return set.ok() ? *std::move(set) : nullptr;
}

RunningShards StartShards(uint32_t num_shards, std::vector<std::string> flags,
                          const std::string& log_dir) {
  RunningShards running;
  running.processes = StartProcesses(num_shards, std::move(flags), log_dir);
  if (running.processes == nullptr) return running;
  running.registry = std::make_shared<prometheus::Registry>();
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(60);
  connect.registry = running.registry;
  auto set = client::ShardSet::Connect(running.processes->addresses(), connect);
  EXPECT_TRUE(set.ok()) << set.status();
  if (set.ok()) running.set = *std::move(set);
  return running;
}

std::optional<double> CounterValue(const prometheus::Registry& registry, const std::string& name) {
  std::optional<double> total;
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name != name) continue;
    total = 0;
    for (const prometheus::ClientMetric& metric : family.metric) {
      *total +=
          family.type == prometheus::MetricType::Gauge ? metric.gauge.value : metric.counter.value;
    }
  }
  return total;
}

std::string WriteAdminToken(const std::string& dir, const std::string& token) {
  const std::string path = dir + "/token";
  std::ofstream(path) << token << "\n";
  std::filesystem::permissions(
      path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  return path;
}

int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  output->clear();
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) output->append(buffer, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool KilledBySigkill(int wait_status) {
  return WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGKILL;
}

std::string DescribeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return "exit status " + std::to_string(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    return "signal " + std::to_string(WTERMSIG(wait_status)) + " (" +
           strsignal(WTERMSIG(wait_status)) + ")";
  }
  return "wait status " + std::to_string(wait_status);
}

}  // namespace layercast::testing
