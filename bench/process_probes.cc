#include "bench/process_probes.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace layercast::bench {
namespace {

// The body of GET /metrics from 127.0.0.1:`port`, or "" if it does not
// answer within a few seconds.
std::string HttpGetMetrics(int port) {
  boost::asio::ip::tcp::iostream stream;
  stream.expires_after(std::chrono::seconds(5));
  stream.connect("127.0.0.1", std::to_string(port));
  if (!stream) return "";
  stream << "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" << std::flush;
  return std::string(std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>());
}

// The value of the sample named exactly `series` (with its labels), or 0.
double Sample(const std::string& exposition, const std::string& series) {
  const size_t at = exposition.find("\n" + series + " ");
  return at == std::string::npos ? 0 : std::stod(exposition.substr(at + series.size() + 2));
}

}  // namespace

namespace {

// Fields 3.. of /proc/`pid`/stat (after the command's parentheses), or none.
std::vector<std::string> StatFields(pid_t pid) {
  std::ifstream file(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 > text.size()) return {};
  std::istringstream stream(text.substr(paren + 2));
  std::vector<std::string> fields;
  for (std::string field; fields.size() < 13 && stream >> field;) fields.push_back(field);
  return fields;
}

}  // namespace

double ProcessCpuSeconds(pid_t pid) {
  const std::vector<std::string> fields = StatFields(pid);
  if (fields.size() < 13) return 0;
  const double ticks = std::stod(fields[14 - 3]) + std::stod(fields[15 - 3]);  // utime, stime
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double ProcessesMinorFaults(const std::vector<pid_t>& pids) {
  double total = 0;
  for (pid_t pid : pids) {
    const std::vector<std::string> fields = StatFields(pid);
    if (fields.size() >= 8) total += std::stod(fields[10 - 3]);  // minflt
  }
  return total;
}

double ProcessesCpuSeconds(const std::vector<pid_t>& pids) {
  double total = 0;
  for (pid_t pid : pids) total += ProcessCpuSeconds(pid);
  return total;
}

double SelfCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

ShardCounters ScrapeShards(const std::vector<int>& ports) {
  ShardCounters total;
  for (int port : ports) {
    const std::string text = HttpGetMetrics(port);
    total.cast_seconds += Sample(text, "layercast_cast_seconds_total");
    total.chunks_cast += Sample(text, R"(layercast_chunks_total{source="cast"})");
    total.chunks_shared += Sample(text, R"(layercast_chunks_total{source="shared"})");
    total.optimizer_seconds_max =
        std::max(total.optimizer_seconds_max, Sample(text, "layercast_optimizer_step_seconds_sum"));
  }
  return total;
}

std::vector<int> MetricsPorts(const std::string& log_dir, uint32_t n) {
  static const std::regex kLine(R"(metrics on 127\.0\.0\.1:(\d+)/metrics)");
  std::vector<int> ports;
  for (uint32_t i = 0; i < n; ++i) {
    std::ifstream log(absl::StrCat(log_dir, "/shard-", i, ".log"));
    std::string line;
    std::smatch match;
    int port = 0;  // logs are appended to: the last start is this one
    while (std::getline(log, line)) {
      if (std::regex_search(line, match, kLine)) port = std::stoi(match[1]);
    }
    if (port != 0) ports.push_back(port);
  }
  return ports;
}

}  // namespace layercast::bench
