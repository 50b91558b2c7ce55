// Gathering layers from real shard servers on 127.0.0.1, measured in one run
// against a baseline from the same run:
//   (a) baseline: N minimal gRPC servers that stream pre-made frames of the
//       same bytes and chunks (bench/baseline_server.h);
//   (b) layercast, policy p=f32,c=bf16 (cast just in time, per chunk);
//   (c) layercast, policy p=f32,c=f32 (the fp32 gather the cast replaces);
//   (d) layercast, policy p=f32,c=bf16 with the cast cache
//       (--cast-cache-bytes, room for the whole model): after the warm-up
//       walk, every read is sent from bytes cast once.
// Reports bytes/s on the wire, parameters/s, server and worker CPU seconds per
// GB delivered, and the ratios b/a, b/c, d/a against their goals. The four take
// turns --repeat times (default 5) and the ratios' medians are the figures.
// What the shard adds to the baseline's CPU is set against the cast alone:
// (server CPU s/GB of b - of a) / (s per GB of bf16 that the dispatched cast
// kernel takes to narrow fp32 from memory in this process), measured in each
// turn; 1.0 means the shard adds nothing but the cast.
// --no-cast-cache leaves (d) out.
//
// --table instead loops N in {1,2,4,8} and W in {1,8} over a smaller model
// (policy b only) and prints bytes/s, time to first byte and p50/p99 per-layer
// gather latency, each configuration bounded to a few seconds.
//
// --sharing loops W in {1,2,4,8} workers walking the same layers, against the
// baseline at the same W, with shared casts on and off (see RunSharing).
//
// --fp8 sets layercast with policy p=f32,c=float8_e4m3fn (block scales of
// 128, counted on the wire) against (b), --repeat turns each: the ratio of
// wire bytes per parameter (goal <= 0.55) and of parameters/s (goal >= 1.7).
//
// Usage: gather_bench [--num-shards N] [--workers W] [--rounds R] [--repeat K]
//                     [--synthetic SPEC] [--table | --sharing | --fp8]
//                     [--shared-chunk-bytes B (with --sharing)] [--no-cast-cache]

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/baseline_server.h"
#include "bench/process_probes.h"
#include "client/shard_set.h"
#include "core/cast.h"
#include "core/layout.h"
#include "platform/byte_size.h"
#include "platform/process_tuning.h"
#include "platform/status_macros.h"
#include "tools/cli_flags.h"
#include "tools/local_shard_set.h"

namespace layercast {
namespace {

constexpr const char* kPolicyBf16 = "p=f32,c=bf16";
constexpr const char* kPolicyF32 = "p=f32,c=f32";
constexpr const char* kPolicyFp8 = "p=f32,c=float8_e4m3fn";

struct Args {
  uint32_t num_shards = 2;
  uint32_t workers = 1;
  uint32_t rounds = 3;
  uint32_t repeat = 5;
  std::string synthetic = "llama:layers=4,hidden=2048,ffn=5632,vocab=32000,seed=1";
  bool table = false;
  bool sharing = false;
  bool fp8 = false;
  std::string shared_chunk_bytes;  // passed to the sharing shards; "" for their default
  bool cast_cache = true;          // row (d) of the default run
};

// A mistyped or unknown flag is an error, not a default silently measured.
absl::StatusOr<Args> ParseArgs(int argc, char** argv) {
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(std::vector<std::string>(argv + 1, argv + argc),
                             {"num-shards", "workers", "rounds", "repeat", "synthetic",
                              "shared-chunk-bytes", "table", "sharing", "fp8", "no-cast-cache"},
                             {"table", "sharing", "fp8", "no-cast-cache"}));
  Args args;
  const auto count = [&](const char* name, uint32_t fallback) -> absl::StatusOr<uint32_t> {
    ASSIGN_OR_RETURN(uint64_t value, flags.GetUint(name, fallback));
    if (value == 0 || value > 1024) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be in 1..1024"));
    }
    return static_cast<uint32_t>(value);
  };
  ASSIGN_OR_RETURN(args.num_shards, count("num-shards", args.num_shards));
  ASSIGN_OR_RETURN(args.workers, count("workers", args.workers));
  ASSIGN_OR_RETURN(args.rounds, count("rounds", args.rounds));
  ASSIGN_OR_RETURN(args.repeat, count("repeat", args.repeat));
  args.synthetic = flags.Get("synthetic", args.synthetic);
  args.shared_chunk_bytes = flags.Get("shared-chunk-bytes");
  args.table = flags.Has("table");
  args.sharing = flags.Has("sharing");
  args.fp8 = flags.Has("fp8");
  args.cast_cache = !flags.Has("no-cast-cache");
  if (args.table + args.sharing + args.fp8 > 1) {
    return absl::InvalidArgumentError("--table, --sharing and --fp8 are separate runs: give one");
  }
  return args;
}

// Shard logs (where the sharing run finds the metrics ports), under the
// system's temporary directory.
std::string LogDir() {
  std::error_code error;
  return (std::filesystem::temp_directory_path(error) / "gather_bench_logs").string();
}

struct Result {
  uint64_t wire_bytes = 0;
  uint64_t params = 0;
  uint64_t gathers = 0;
  double seconds = 0;
  double server_cpu = 0;
  double worker_cpu = 0;
  double server_faults = 0;        // minor page faults of the servers
  std::vector<double> latencies;   // per-layer gather, seconds
  std::vector<double> first_byte;  // gather start to first chunk placed, seconds
  bench::ShardCounters shards;     // what the shards counted, when scraped
  double bytes_per_s() const { return wire_bytes / seconds; }
  double params_per_s() const { return params / seconds; }
  double server_cpu_per_gb() const { return server_cpu / (wire_bytes / 1e9); }
  double worker_cpu_per_gb() const { return worker_cpu / (wire_bytes / 1e9); }
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  return v[i];
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

// Seconds per GB of bf16 out that the dispatched kernel takes to narrow fp32
// from memory (2 GB read per GB written), as a shard's cast does: the median
// of 5 passes over 256 MiB of fp32, more than a last-level cache holds.
double CastOnlySecondsPerGb() {
  constexpr size_t kElements = size_t{64} << 20;
  static std::vector<float>* const src = [] {
    auto* values = new std::vector<float>(kElements);
    for (size_t i = 0; i < kElements; ++i) {
      (*values)[i] = static_cast<float>(static_cast<int>(i % 4093) - 2046) * 1e-5f;
    }
    return values;
  }();
  static std::vector<uint16_t>* const dst = new std::vector<uint16_t>(kElements);
  std::vector<double> seconds;
  for (int pass = 0; pass < 5; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    CastF32ToBF16(*src, *dst);
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return Median(seconds) / (kElements * sizeof(uint16_t) / 1e9);
}

// W workers, each with its own ShardSet to `addresses`, walk every layer
// `rounds` times (stopping early once `limit` has passed). Servers' CPU is
// read from `server_pids`.
absl::StatusOr<Result> Measure(const std::vector<std::string>& addresses,
                               const std::vector<pid_t>& server_pids, uint32_t workers,
                               uint32_t rounds, std::chrono::milliseconds limit,
                               const std::vector<int>& metrics_ports = {}, bool lockstep = false) {
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::minutes(2);
  std::vector<std::unique_ptr<client::ShardSet>> sets;
  for (uint32_t w = 0; w < workers; ++w) {
    auto set = client::ShardSet::Connect(addresses, connect);
    if (!set.ok()) return set.status();
    sets.push_back(*std::move(set));
  }
  const wire::ShardSetView& view = sets[0]->view();
  const uint32_t num_layers = static_cast<uint32_t>(view.layouts.size());
  uint64_t largest = 0;
  std::vector<uint64_t> layer_wire(num_layers), layer_params(num_layers);
  for (uint32_t l = 0; l < num_layers; ++l) {
    largest = std::max(largest, view.layouts[l].total_bytes());
    for (const AssembledTensor& t : view.layouts[l].tensors()) {
      layer_wire[l] += t.num_bytes() + t.scale_bytes();
      layer_params[l] += t.num_elements;
    }
  }
  // One reused, touched buffer per worker: page faults of fresh buffers are
  // not what is measured here.
  std::vector<std::vector<uint8_t>> buffers(workers, std::vector<uint8_t>(largest, 1));
  // Warm-up: every worker gathers every layer once (connections, flow
  // control windows, allocator).
  for (uint32_t w = 0; w < workers; ++w) {
    for (uint32_t l = 0; l < num_layers; ++l) {
      auto v = sets[w]->GatherInto(l, {}, buffers[w]);
      if (!v.ok()) return v.status();
    }
  }

  std::vector<Result> per_worker(workers);
  std::vector<absl::Status> errors(workers);
  const bench::ShardCounters counters_before = bench::ScrapeShards(metrics_ports);
  const double server_before = bench::ProcessesCpuSeconds(server_pids);
  const double faults_before = bench::ProcessesMinorFaults(server_pids);
  const double self_before = bench::SelfCpuSeconds();
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + limit;
  // A round is a training step when `lockstep`: data-parallel workers meet at
  // the gradient all-reduce before the next step's walk.
  std::barrier step(static_cast<std::ptrdiff_t>(workers));
  std::atomic<bool> out_of_time{false};
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      Result& r = per_worker[w];
      for (uint32_t round = 0; round < rounds; ++round) {
        if (lockstep) {
          if (round > 0 && std::chrono::steady_clock::now() > deadline) out_of_time = true;
          step.arrive_and_wait();
          if (out_of_time) return;
        }
        for (uint32_t l = 0; l < num_layers; ++l) {
          if (!lockstep && round > 0 && std::chrono::steady_clock::now() > deadline) return;
          std::atomic<int64_t> first_ns{-1};
          const auto t0 = std::chrono::steady_clock::now();
          client::GatherOptions options;
          options.on_chunk = [&first_ns, t0](uint64_t) {
            if (first_ns.load(std::memory_order_relaxed) >= 0) return;
            int64_t expected = -1;
            first_ns.compare_exchange_strong(expected,
                                             std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                 std::chrono::steady_clock::now() - t0)
                                                 .count());
          };
          auto version = sets[w]->GatherInto(l, options, buffers[w]);
          const double took =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (!version.ok()) {
            errors[w] = version.status();
            if (lockstep) step.arrive_and_drop();
            return;
          }
          r.latencies.push_back(took);
          r.first_byte.push_back(first_ns.load() * 1e-9);
          r.wire_bytes += layer_wire[l];
          r.params += layer_params[l];
          ++r.gathers;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  Result total;
  total.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  total.worker_cpu = bench::SelfCpuSeconds() - self_before;
  total.server_cpu = bench::ProcessesCpuSeconds(server_pids) - server_before;
  total.server_faults = bench::ProcessesMinorFaults(server_pids) - faults_before;
  const bench::ShardCounters counters_after = bench::ScrapeShards(metrics_ports);
  total.shards.cast_seconds = counters_after.cast_seconds - counters_before.cast_seconds;
  total.shards.chunks_cast = counters_after.chunks_cast - counters_before.chunks_cast;
  total.shards.chunks_shared = counters_after.chunks_shared - counters_before.chunks_shared;
  for (uint32_t w = 0; w < workers; ++w) {
    if (!errors[w].ok()) return errors[w];
    total.wire_bytes += per_worker[w].wire_bytes;
    total.params += per_worker[w].params;
    total.gathers += per_worker[w].gathers;
    total.latencies.insert(total.latencies.end(), per_worker[w].latencies.begin(),
                           per_worker[w].latencies.end());
    total.first_byte.insert(total.first_byte.end(), per_worker[w].first_byte.begin(),
                            per_worker[w].first_byte.end());
  }
  return total;
}

absl::StatusOr<std::unique_ptr<tools::LocalShardSet>> StartShards(
    uint32_t n, const std::string& synthetic, const std::string& policy,
    std::vector<std::string> more_flags = {}, const std::string& log_dir = LogDir()) {
  tools::LocalShardSet::Options options;
  options.shard_binary = LAYERCAST_SHARD_BINARY;
  options.num_shards = n;
  options.extra_flags = {"--synthetic", synthetic, "--policy", policy};
  options.extra_flags.insert(options.extra_flags.end(), more_flags.begin(), more_flags.end());
  std::error_code ignored;
  std::filesystem::create_directories(log_dir, ignored);
  options.log_dir = log_dir;
  return tools::LocalShardSet::Start(options);
}

std::vector<pid_t> Pids(const tools::LocalShardSet& shards, uint32_t n) {
  std::vector<pid_t> pids;
  for (uint32_t i = 0; i < n; ++i) pids.push_back(shards.pid(i));
  return pids;
}

// Measure() against a shard set this process started.
absl::StatusOr<Result> MeasureSet(const tools::LocalShardSet& shards, const Args& args,
                                  std::chrono::milliseconds limit) {
  return Measure(shards.addresses(), Pids(shards, args.num_shards), args.workers, args.rounds,
                 limit);
}

int Fail(const absl::Status& status, const char* what) {
  std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
  return 1;
}

// The column heads of PrintRow's rows.
void PrintHeader() {
  std::printf("%-30s %11s %14s %9s %9s %8s %8s %6s\n", "", "wire", "params", "srv CPU", "wkr CPU",
              "p50", "p50 TTFB", "layers");
  std::printf("%-30s %11s %14s %9s %9s %8s %8s %6s\n", "", "bytes/s", "/s", "s/GB", "s/GB", "ms",
              "ms", "");
}

void PrintRow(const char* name, const Result& r) {
  std::printf("%-30s %9s/s %10.3f G/s %9.3f %9.3f %8.2f %8.2f %6llu\n", name,
              FormatBytes(static_cast<uint64_t>(r.bytes_per_s())).c_str(), r.params_per_s() / 1e9,
              r.server_cpu_per_gb(), r.worker_cpu_per_gb(), Percentile(r.latencies, 0.5) * 1e3,
              Percentile(r.first_byte, 0.5) * 1e3, static_cast<unsigned long long>(r.gathers));
}

int RunDefault(const Args& args) {
  // Before any gRPC object exists in this process.
  std::vector<bench::BaselineProcess> baselines = bench::ForkBaselines(args.num_shards);
  if (baselines.size() != args.num_shards) return 1;
  const std::chrono::milliseconds limit = std::chrono::seconds(60);

  auto bf16_shards = StartShards(args.num_shards, args.synthetic, kPolicyBf16);
  if (!bf16_shards.ok()) return Fail(bf16_shards.status(), "starting shards (b)");
  auto f32_shards = StartShards(args.num_shards, args.synthetic, kPolicyF32);
  if (!f32_shards.ok()) return Fail(f32_shards.status(), "starting shards (c)");
  // Room for every layer of any model the bench is given: the cache holds
  // what the shard's layers take, no more.
  absl::StatusOr<std::unique_ptr<tools::LocalShardSet>> cached_shards;
  if (args.cast_cache) {
    cached_shards = StartShards(args.num_shards, args.synthetic, kPolicyBf16,
                                {"--cast-cache-bytes", absl::StrCat(uint64_t{1} << 40)});
    if (!cached_shards.ok()) return Fail(cached_shards.status(), "starting shards (d)");
  }
  auto baseline = bench::ServeBaselines(baselines, (*bf16_shards)->addresses());
  if (!baseline.ok()) return Fail(baseline.status(), "starting the baseline (a)");
  const std::vector<std::string>& baseline_addresses = baseline->addresses;
  const std::vector<pid_t>& baseline_pids = baseline->pids;
  const uint64_t assembled = baseline->assembled;
  const size_t num_layers = baseline->num_layers;

  std::printf(
      "gather_bench: %s, %u shards, %u worker(s), %u rounds, %zu layers (%s per walk at bf16)\n"
      "machine: 2 cores shared by servers and workers, nothing pinned: compare within this run\n"
      "cast kernels (this process's measurement): %s\n\n",
      args.synthetic.c_str(), args.num_shards, args.workers, args.rounds, num_layers,
      FormatBytes(assembled).c_str(), SelectedCastIsa().Summary().c_str());
  PrintHeader();

  // The ratios of each turn; their medians are the figures.
  std::vector<double> bytes_b_a, params_b_c, cpu_b_a, worker_b_a, added_per_cast, cast_s_per_gb,
      bytes_d_a, bytes_d_b, cpu_d_a;
  for (uint32_t turn = 1; turn <= args.repeat; ++turn) {
    auto a = Measure(baseline_addresses, baseline_pids, args.workers, args.rounds, limit);
    if (!a.ok()) return Fail(a.status(), "baseline (a)");
    auto b = MeasureSet(**bf16_shards, args, limit);
    if (!b.ok()) return Fail(b.status(), "layercast bf16 (b)");
    auto c = MeasureSet(**f32_shards, args, limit);
    if (!c.ok()) return Fail(c.status(), "layercast f32 (c)");
    std::optional<Result> d;
    if (args.cast_cache) {
      absl::StatusOr<Result> measured = MeasureSet(**cached_shards, args, limit);
      if (!measured.ok()) return Fail(measured.status(), "layercast bf16, cast cache (d)");
      d = *std::move(measured);
    }
    const double cast = CastOnlySecondsPerGb();
    PrintRow(absl::StrCat("(a) baseline, pre-made  #", turn).c_str(), *a);
    PrintRow(absl::StrCat("(b) layercast c=bf16    #", turn).c_str(), *b);
    PrintRow(absl::StrCat("(c) layercast c=f32     #", turn).c_str(), *c);
    if (d) {
      PrintRow(absl::StrCat("(d) c=bf16, cast cache  #", turn).c_str(), *d);
      bytes_d_a.push_back(d->bytes_per_s() / a->bytes_per_s());
      bytes_d_b.push_back(d->bytes_per_s() / b->bytes_per_s());
      cpu_d_a.push_back(d->server_cpu_per_gb() / a->server_cpu_per_gb());
    }
    const double added = (b->server_cpu_per_gb() - a->server_cpu_per_gb()) / cast;
    std::printf(
        "%-30s cast alone %.3f s/GB of bf16; shard adds %.2fx that; shard page faults "
        "per GB a %.0f, b %.0f\n",
        "", cast, added, a->server_faults / (a->wire_bytes / 1e9),
        b->server_faults / (b->wire_bytes / 1e9));
    std::fflush(stdout);
    bytes_b_a.push_back(b->bytes_per_s() / a->bytes_per_s());
    params_b_c.push_back(b->params_per_s() / c->params_per_s());
    cpu_b_a.push_back(b->server_cpu_per_gb() / a->server_cpu_per_gb());
    worker_b_a.push_back(b->worker_cpu_per_gb() / a->worker_cpu_per_gb());
    added_per_cast.push_back(added);
    cast_s_per_gb.push_back(cast);
  }
  bench::StopBaselines(baselines);
  const absl::Status stopped_b = (*bf16_shards)->Stop();
  const absl::Status stopped_c = (*f32_shards)->Stop();
  const absl::Status stopped_d = args.cast_cache ? (*cached_shards)->Stop() : absl::OkStatus();

  std::printf("\nmedians of %u turns\n", args.repeat);
  std::printf("%-44s %7.3f   goal >= 0.95\n", "b/a wire bytes/s:", Median(bytes_b_a));
  std::printf("%-44s %7.3f   goal >= 1.8\n", "b/c parameters/s:", Median(params_b_c));
  std::printf("%-44s %7.3f   goal <= 1.2\n",
              "(b-a server CPU s/GB) / cast-only s/GB:", Median(added_per_cast));
  std::printf("%-44s %7.3f   (cast alone, s per GB of bf16)\n",
              "cast-only s/GB:", Median(cast_s_per_gb));
  std::printf("%-44s %7.3f   (no goal)\n", "b/a server CPU s/GB:", Median(cpu_b_a));
  std::printf("%-44s %7.3f   (no goal)\n", "b/a worker CPU s/GB:", Median(worker_b_a));
  if (args.cast_cache) {
    std::printf("%-44s %7.3f   goal >= 0.9\n", "d/a wire bytes/s (cast cache):", Median(bytes_d_a));
    std::printf("%-44s %7.3f   (no goal)\n", "d/a server CPU s/GB:", Median(cpu_d_a));
    std::printf("%-44s %7.3f   (no goal: the cache against the cast)\n",
                "d/b wire bytes/s:", Median(bytes_d_b));
  }
  if (!stopped_b.ok() || !stopped_c.ok() || !stopped_d.ok()) {
    std::fprintf(stderr, "shard exit: %s / %s / %s\n", stopped_b.ToString().c_str(),
                 stopped_c.ToString().c_str(), stopped_d.ToString().c_str());
    return 1;
  }
  return 0;
}

int RunTable(const Args& args) {
  const std::string synthetic = args.synthetic == Args().synthetic
                                    ? "llama:layers=4,hidden=1024,ffn=2816,vocab=32000,seed=2"
                                    : args.synthetic;
  const std::chrono::milliseconds limit = std::chrono::seconds(5);
  std::printf(
      "gather_bench --table: %s, policy %s, up to %u rounds or %llds per configuration\n"
      "machine: 2 cores shared by servers and workers, nothing pinned: compare within this run\n\n",
      synthetic.c_str(), kPolicyBf16, args.rounds, static_cast<long long>(limit.count() / 1000));
  std::printf("%3s %3s %12s %10s %10s %10s %10s %8s\n", "N", "W", "bytes/s", "TTFB p50", "TTFB p99",
              "lat p50", "lat p99", "layers");
  for (uint32_t n : {1u, 2u, 4u, 8u}) {
    auto shards = StartShards(n, synthetic, kPolicyBf16);
    if (!shards.ok()) return Fail(shards.status(), "starting shards");
    for (uint32_t w : {1u, 8u}) {
      auto r = Measure((*shards)->addresses(), Pids(**shards, n), w, args.rounds, limit);
      if (!r.ok()) return Fail(r.status(), "gather");
      std::printf("%3u %3u %10s/s %8.2fms %8.2fms %8.2fms %8.2fms %8llu\n", n, w,
                  FormatBytes(static_cast<uint64_t>(r->bytes_per_s())).c_str(),
                  Percentile(r->first_byte, 0.5) * 1e3, Percentile(r->first_byte, 0.99) * 1e3,
                  Percentile(r->latencies, 0.5) * 1e3, Percentile(r->latencies, 0.99) * 1e3,
                  static_cast<unsigned long long>(r->gathers));
      std::fflush(stdout);
    }
    const absl::Status stopped = (*shards)->Stop();
    if (!stopped.ok()) return Fail(stopped, "stopping shards");
  }
  return 0;
}

// Cast once, send to many: W workers walking the same layers together, for
// W = 1, 2, 4, 8, in lockstep (each round a step that every worker finishes
// before the next begins), against the baseline at the same W, with sharing
// on (the default) and off (--shared-chunk-bytes 0). The shards' own metrics give the
// share of chunks sent without a cast and the seconds spent casting per GB of
// distinct model bytes (each distinct byte goes to W workers): flat in W when
// casts are shared, growing with W when every stream casts its own.
int RunSharing(const Args& args) {
  const std::string synthetic = args.synthetic == Args().synthetic
                                    ? "llama:layers=4,hidden=1024,ffn=2816,vocab=32000,seed=2"
                                    : args.synthetic;
  const std::chrono::milliseconds limit = std::chrono::seconds(8);
  std::vector<bench::BaselineProcess> baselines = bench::ForkBaselines(args.num_shards);
  if (baselines.size() != args.num_shards) return 1;
  const std::string shared_logs = absl::StrCat(LogDir(), "/shared");
  const std::string unshared_logs = absl::StrCat(LogDir(), "/unshared");
  std::vector<std::string> shared_flags = {"--metrics-listen", "127.0.0.1:0"};
  if (!args.shared_chunk_bytes.empty()) {
    shared_flags.insert(shared_flags.end(), {"--shared-chunk-bytes", args.shared_chunk_bytes});
  }
  auto shared = StartShards(args.num_shards, synthetic, kPolicyBf16, shared_flags, shared_logs);
  if (!shared.ok()) return Fail(shared.status(), "starting shards (sharing)");
  auto unshared =
      StartShards(args.num_shards, synthetic, kPolicyBf16,
                  {"--metrics-listen", "127.0.0.1:0", "--shared-chunk-bytes", "0"}, unshared_logs);
  if (!unshared.ok()) return Fail(unshared.status(), "starting shards (no sharing)");
  auto baseline = bench::ServeBaselines(baselines, (*shared)->addresses());
  if (!baseline.ok()) return Fail(baseline.status(), "starting the baseline");
  const std::vector<int> shared_ports = bench::MetricsPorts(shared_logs, args.num_shards);
  const std::vector<int> unshared_ports = bench::MetricsPorts(unshared_logs, args.num_shards);
  if (shared_ports.size() != args.num_shards || unshared_ports.size() != args.num_shards) {
    std::fprintf(stderr, "no metrics port in the shard logs under %s\n", LogDir().c_str());
    return 1;
  }

  std::printf(
      "gather_bench --sharing: %s, %u shards, policy %s, up to %u rounds or %llds per row\n"
      "machine: 2 cores shared by servers and workers, nothing pinned: compare within a row\n\n",
      synthetic.c_str(), args.num_shards, kPolicyBf16, args.rounds,
      static_cast<long long>(limit.count() / 1000));
  std::printf("%3s | %11s | %11s %6s %7s %8s | %11s %6s %8s\n", "", "(a)", "shared", "", "",
              "cast s", "unshared", "", "cast s");
  std::printf("%3s | %11s | %11s %6s %7s %8s | %11s %6s %8s\n", "W", "bytes/s", "bytes/s", "/a",
              "shared", "/dist.GB", "bytes/s", "/a", "/dist.GB");
  for (uint32_t w : {1u, 2u, 4u, 8u}) {
    auto a = Measure(baseline->addresses, baseline->pids, w, args.rounds, limit, {},
                     /*lockstep=*/true);
    if (!a.ok()) return Fail(a.status(), "baseline");
    auto s = Measure((*shared)->addresses(), Pids(**shared, args.num_shards), w, args.rounds, limit,
                     shared_ports, /*lockstep=*/true);
    if (!s.ok()) return Fail(s.status(), "sharing");
    auto u = Measure((*unshared)->addresses(), Pids(**unshared, args.num_shards), w, args.rounds,
                     limit, unshared_ports, /*lockstep=*/true);
    if (!u.ok()) return Fail(u.status(), "no sharing");
    const auto cast_per_distinct_gb = [w](const Result& r) {
      return r.shards.cast_seconds / (static_cast<double>(r.wire_bytes) / w / 1e9);
    };
    const double sent = s->shards.chunks_cast + s->shards.chunks_shared;
    std::printf("%3u | %9s/s | %9s/s %6.3f %6.1f%% %8.3f | %9s/s %6.3f %8.3f\n", w,
                FormatBytes(static_cast<uint64_t>(a->bytes_per_s())).c_str(),
                FormatBytes(static_cast<uint64_t>(s->bytes_per_s())).c_str(),
                s->bytes_per_s() / a->bytes_per_s(),
                sent > 0 ? 100 * s->shards.chunks_shared / sent : 0.0, cast_per_distinct_gb(*s),
                FormatBytes(static_cast<uint64_t>(u->bytes_per_s())).c_str(),
                u->bytes_per_s() / a->bytes_per_s(), cast_per_distinct_gb(*u));
    std::fflush(stdout);
  }
  bench::StopBaselines(baselines);
  const absl::Status stopped_shared = (*shared)->Stop();
  const absl::Status stopped_unshared = (*unshared)->Stop();
  if (!stopped_shared.ok()) return Fail(stopped_shared, "stopping shards");
  if (!stopped_unshared.ok()) return Fail(stopped_unshared, "stopping shards");
  return 0;
}

// fp8 against bf16 on the same model and shard count, taking turns.
int RunFp8(const Args& args) {
  const std::chrono::milliseconds limit = std::chrono::seconds(30);
  auto bf16_shards = StartShards(args.num_shards, args.synthetic, kPolicyBf16);
  if (!bf16_shards.ok()) return Fail(bf16_shards.status(), "starting shards (bf16)");
  auto fp8_shards = StartShards(args.num_shards, args.synthetic, kPolicyFp8);
  if (!fp8_shards.ok()) return Fail(fp8_shards.status(), "starting shards (fp8)");
  std::printf(
      "gather_bench --fp8: %s, %u shards, %u worker(s), %u rounds\n"
      "machine: 2 cores shared by servers and workers, nothing pinned: compare within this run\n\n",
      args.synthetic.c_str(), args.num_shards, args.workers, args.rounds);
  PrintHeader();
  std::vector<double> bytes_per_param, params_ratio;
  for (uint32_t turn = 1; turn <= args.repeat; ++turn) {
    auto b = MeasureSet(**bf16_shards, args, limit);
    if (!b.ok()) return Fail(b.status(), "layercast bf16");
    auto f = MeasureSet(**fp8_shards, args, limit);
    if (!f.ok()) return Fail(f.status(), "layercast fp8");
    PrintRow(absl::StrCat("c=bf16              #", turn).c_str(), *b);
    PrintRow(absl::StrCat("c=float8_e4m3fn     #", turn).c_str(), *f);
    std::fflush(stdout);
    bytes_per_param.push_back((static_cast<double>(f->wire_bytes) / f->params) /
                              (static_cast<double>(b->wire_bytes) / b->params));
    params_ratio.push_back(f->params_per_s() / b->params_per_s());
  }
  const absl::Status stopped_b = (*bf16_shards)->Stop();
  const absl::Status stopped_f = (*fp8_shards)->Stop();
  std::printf("\nmedians of %u turns\n", args.repeat);
  std::printf("%-44s %7.3f   goal <= 0.55\n",
              "fp8/bf16 wire bytes per parameter:", Median(bytes_per_param));
  std::printf("%-44s %7.3f   goal >= 1.7\n", "fp8/bf16 parameters/s:", Median(params_ratio));
  if (!stopped_b.ok()) return Fail(stopped_b, "stopping shards (bf16)");
  if (!stopped_f.ok()) return Fail(stopped_f, "stopping shards (fp8)");
  return 0;
}

}  // namespace
}  // namespace layercast

int main(int argc, char** argv) {
  layercast::TuneOwnProcess(/*keep_lock_order_checks=*/false);  // as layercast-shard
  const absl::StatusOr<layercast::Args> parsed = layercast::ParseArgs(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "gather_bench: %s\nusage: see the top of bench/gather_bench.cc\n",
                 std::string(parsed.status().message()).c_str());
    return 2;
  }
  const layercast::Args& args = *parsed;
  if (args.sharing) return layercast::RunSharing(args);
  if (args.fp8) return layercast::RunFp8(args);
  return args.table ? layercast::RunTable(args) : layercast::RunDefault(args);
}
