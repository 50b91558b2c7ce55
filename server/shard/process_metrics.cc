#include "server/shard/process_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace layercast::server {
namespace {

prometheus::MetricFamily Family(const char* name, const char* help, prometheus::MetricType type,
                                double value) {
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return prometheus::MetricFamily{name, help, type, {metric}};
}

// Fields of /proc/self/stat after the command name (which may hold spaces),
// numbered as in proc(5) from field 3, `state`.
std::vector<std::string> StatFields() {
  std::ifstream file("/proc/self/stat");
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  std::vector<std::string> fields;
  if (paren == std::string::npos) return fields;
  std::istringstream rest(text.substr(paren + 2));
  for (std::string field; rest >> field;) fields.push_back(field);
  return fields;
}

// Seconds since the epoch at which the system booted (/proc/stat btime).
double BootTime() {
  std::ifstream file("/proc/stat");
  for (std::string key; file >> key;) {
    if (key == "btime") {
      double seconds = 0;
      file >> seconds;
      return seconds;
    }
    file.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

}  // namespace

std::vector<prometheus::MetricFamily> ProcessMetrics::Collect() const {
  const std::vector<std::string> stat = StatFields();
  // proc(5): utime 14, stime 15, starttime 22, vsize 23, rss 24 (from 3).
  const auto field = [&](size_t number) {
    return stat.size() > number - 3 ? std::stod(stat[number - 3]) : 0.0;
  };
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  std::error_code error;
  double open_fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    ++open_fds;
  }
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  using prometheus::MetricType;
  return {
      Family("process_resident_memory_bytes", "Resident memory size in bytes.", MetricType::Gauge,
             field(24) * page),
      Family("process_virtual_memory_bytes", "Virtual memory size in bytes.", MetricType::Gauge,
             field(23)),
      Family("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
             MetricType::Counter, (field(14) + field(15)) / ticks),
      Family("process_open_fds", "Number of open file descriptors.", MetricType::Gauge, open_fds),
      Family("process_max_fds", "Maximum number of open file descriptors.", MetricType::Gauge,
             static_cast<double>(files.rlim_cur)),
      Family("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
             MetricType::Gauge, BootTime() + field(22) / ticks),
  };
}

}  // namespace layercast::server
