#pragma once

// What gather_bench reads about the processes it measures: CPU seconds from
// /proc, and the shards' own counters from their /metrics.

#include <sys/types.h>

#include <string>
#include <vector>

namespace layercast::bench {

// utime + stime of process `pid`, seconds; 0 if it cannot be read.
double ProcessCpuSeconds(pid_t pid);
double ProcessesCpuSeconds(const std::vector<pid_t>& pids);
// Minor page faults of `pids`, summed: a fault is a page touched for the
// first time (or again after the allocator gave it back).
double ProcessesMinorFaults(const std::vector<pid_t>& pids);
double SelfCpuSeconds();

// What the shards say they did, summed over shards.
struct ShardCounters {
  double cast_seconds = 0;
  double chunks_cast = 0;
  double chunks_shared = 0;
  // Seconds the optimizer ran (layercast_optimizer_step_seconds_sum): the
  // largest of any one shard, since shards step in parallel.
  double optimizer_seconds_max = 0;
};

// Scrapes http://127.0.0.1:PORT/metrics of each port; a shard that does not
// answer counts as zeros.
ShardCounters ScrapeShards(const std::vector<int>& ports);

// The metrics ports that shards started with --metrics-listen 127.0.0.1:0
// logged to LOG_DIR/shard-I.log, for shards 0..n-1 (the latest start each).
std::vector<int> MetricsPorts(const std::string& log_dir, uint32_t n);

}  // namespace layercast::bench
