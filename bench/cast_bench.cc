// Narrowing 64 MiB of fp32 and widening it back with each kernel variant,
// against memcpy of the same 64 MiB, the bound a streaming cast is judged
// by; and the shard's cast without and with its cast-error measurement.
// Throughput counts fp32 bytes (read when narrowing, written when widening)
// for every benchmark, so the GB/s compare directly.

#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "core/cast_error.h"
#include "core/crc32c.h"
#include "core/fp8.h"
#include "wire/slice_digest.h"

namespace layercast {
namespace {

constexpr size_t kElements = size_t{16} << 20;  // 64 MiB of fp32
constexpr int64_t kInputBytes = kElements * sizeof(float);

// The shard's default --cast-error-sample-every: the +error rows measure as
// a shard does.
constexpr uint32_t kSampleEvery = 17;

// Weights as a model holds them: small normals, some fp16 subnormals, no
// overflow (kError, the policy default, must not stop early).
const std::vector<float>& Input() {
  static const std::vector<float>* const input = [] {
    auto* values = new std::vector<float>(kElements);
    std::mt19937 random(1);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (float& v : *values) v = normal(random);
    return values;
  }();
  return *input;
}

void BM_Memcpy(benchmark::State& state) {
  const std::vector<float>& in = Input();
  std::vector<float> out(kElements);  // zeroed, so its pages are mapped before timing
  for (auto _ : state) {
    std::memcpy(out.data(), in.data(), kInputBytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

void BM_F32ToBF16(benchmark::State& state, CastIsa isa) {
  const std::vector<float>& in = Input();
  std::vector<uint16_t> out(kElements);
  for (auto _ : state) {
    CastF32ToBF16(in, out, isa);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

void BM_F32ToF16(benchmark::State& state, CastIsa isa) {
  const std::vector<float>& in = Input();
  std::vector<uint16_t> out(kElements);
  for (auto _ : state) {
    if (absl::Status status = CastF32ToF16(in, out, Fp16Overflow::kError, isa); !status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

// Widening, as a worker's output=float32 policy does: 32 MiB of 16-bit values
// to 64 MiB of fp32, counted in fp32 bytes like the rest.
void BM_Widen(benchmark::State& state, CastIsa isa, bool bf16) {
  const std::vector<float>& in = Input();
  std::vector<uint16_t> narrow(kElements);
  if (bf16) {
    CastF32ToBF16(in, narrow, CastIsa::kScalar);
  } else if (!CastF32ToF16(in, narrow, Fp16Overflow::kError, CastIsa::kScalar).ok()) {
    state.SkipWithError("the input overflows float16");
    return;
  }
  std::vector<float> out(kElements);
  for (auto _ : state) {
    if (bf16) {
      CastBF16ToF32(narrow, out, isa);
    } else {
      CastF16ToF32(narrow, out, isa);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

// The shard's cast (CastFromF32 at the dispatched kernel), without and with
// the cast-error measurement fused into it: over the whole input from memory
// (`piece` kElements), or over the first `piece` elements again and again,
// kElements in all, so that input and output stay in the core's cache. The
// cached rows tell whether the measurement waits on memory or on the core.
void BM_ShardCast(benchmark::State& state, DType to, bool measure, size_t piece) {
  const std::vector<float>& in = Input();
  std::vector<uint16_t> out(piece);
  CastError error;
  error.sample_every = kSampleEvery;
  for (auto _ : state) {
    for (size_t done = 0; done < kElements; done += piece) {
      if (absl::Status status = CastFromF32(in.data(), out.data(), piece, to, Fp16Overflow::kError,
                                            measure ? &error : nullptr);
          !status.ok()) {
        state.SkipWithError(status.ToString().c_str());
        return;
      }
    }
    benchmark::ClobberMemory();
  }
  benchmark::DoNotOptimize(error.measured);
  // The last piece may run past kElements: count what was cast.
  const int64_t pieces = static_cast<int64_t>((kElements + piece - 1) / piece);
  state.SetBytesProcessed(state.iterations() * pieces *
                          static_cast<int64_t>(piece * sizeof(float)));
}

// fp8 with one fp32 scale per block of 128 (the absolute maximum, then the
// division), by kernel, and with the cast-error measurement: against
// shard_cast/bf16, fp8 writes half the bytes plus 4 per block (0.516x).
void BM_QuantizeFp8(benchmark::State& state, Fp8Format format, CastIsa isa, bool measure) {
  constexpr size_t kFp8Block = 128;
  const std::vector<float>& in = Input();
  std::vector<uint8_t> out(kElements);
  std::vector<float> scales(Fp8BlockCount(kElements, kFp8Block));
  CastError error;
  error.sample_every = kSampleEvery;
  for (auto _ : state) {
    QuantizeFp8(in, kFp8Block, format, out, scales, measure ? &error : nullptr, isa);
    benchmark::ClobberMemory();
  }
  benchmark::DoNotOptimize(error.measured);
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

// The measurement alone, by kernel, as CastFromF32 runs it: on a piece of
// 2048 elements just cast, in L1, here the same piece 8192 times (64 MiB of fp32).
void BM_Measure(benchmark::State& state, CastIsa isa, DType to) {
  constexpr size_t kPiece = 2048;
  const std::vector<float>& in = Input();
  std::vector<uint16_t> out(kPiece);
  if (!CastFromF32(in.data(), out.data(), kPiece, to, Fp16Overflow::kInfinity).ok()) {
    state.SkipWithError("the input overflows");
    return;
  }
  CastError error;
  for (auto _ : state) {
    for (size_t done = 0; done < kElements; done += kPiece) {
      MeasureCastError(in.data(), out.data(), kPiece, to, &error, isa);
    }
  }
  benchmark::DoNotOptimize(error.measured);
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

// What a shard adds per chunk after the cast: the CRC-32C of the bf16 bytes,
// half the fp32 input's size, over the same fp32 input bytes as the others.
void BM_Crc32cOfBf16(benchmark::State& state, Crc32cPath path) {
  const std::vector<float>& in = Input();
  for (auto _ : state) {
    benchmark::DoNotOptimize(Crc32c(in.data(), kInputBytes / 2, 0, path));
  }
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

// As a shard checksums a chunk: one call per 48 KiB block it has just cast
// (server/serving/fetch_layer_reactor.cc), so a cost per call shows. (One did: every
// carry-less multiplication call ran CPUID, ~10 us in a virtual machine.)
void BM_Crc32cOfBf16Blocks(benchmark::State& state, Crc32cPath path) {
  constexpr size_t kBlockBytes = 48 << 10;
  constexpr size_t kBytes = kInputBytes / 2;
  const auto* bytes = reinterpret_cast<const uint8_t*>(Input().data());
  for (auto _ : state) {
    uint32_t crc = 0;
    for (size_t at = 0; at < kBytes; at += kBlockBytes) {
      crc = Crc32c(bytes + at, std::min(kBlockBytes, kBytes - at), crc, path);
    }
    benchmark::DoNotOptimize(crc);
  }
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

// What a shard adds per layer, version and dtype a reader asks a digest of
// (GetLayerDigest, wire/slice_digest.h): SHA-256 over the bf16 bytes it
// serves, counted, as the CRC above, per fp32 input byte, so its rate
// reads beside shard_cast/bf16's. Once per version, not per reader.
void BM_SliceDigestOfBf16(benchmark::State& state) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(Input().data());
  for (auto _ : state) {
    wire::SliceDigest digest;
    digest.BeginTensor(0, false);
    digest.AddElements({bytes, kInputBytes / 2});
    benchmark::DoNotOptimize(digest.Finish());
  }
  state.SetBytesProcessed(state.iterations() * kInputBytes);
}

const char* PathName(Crc32cPath path) {
  switch (path) {
    case Crc32cPath::kTable:
      return "table";
    case Crc32cPath::kInstruction:
      return "instruction";
    case Crc32cPath::kCarrylessMultiply:
      return "clmul";
  }
  return "unknown";
}

// The telemetry's cost as the median of back-to-back pairs, each the same
// 64 MiB cast without and with the measurement, the order alternating: on a
// shared machine the throughput drifts between two Google Benchmark runs a
// second apart by more than the 10% goal, and drift cancels within a pair.
// `cast(error)` casts all of Input(), measuring into `error` when non-null.
template <typename Cast>
double PairedTelemetryCost(uint32_t sample_every, Cast&& cast) {
  constexpr int kPairs = 21;
  CastError error;
  error.sample_every = sample_every;
  auto seconds = [&](CastError* measure) {
    const auto start = std::chrono::steady_clock::now();
    cast(measure);
    benchmark::ClobberMemory();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  cast(&error);  // outputs' pages mapped, caches and the dispatcher warm
  std::vector<double> ratios;
  for (int pair = 0; pair < kPairs; ++pair) {
    double plain, measured;
    if (pair % 2 == 0) {
      plain = seconds(nullptr);
      measured = seconds(&error);
    } else {
      measured = seconds(&error);
      plain = seconds(nullptr);
    }
    ratios.push_back(measured / plain);
  }
  benchmark::DoNotOptimize(error.measured);
  std::nth_element(ratios.begin(), ratios.begin() + kPairs / 2, ratios.end());
  return ratios[kPairs / 2] - 1;
}

void PrintPairedTelemetryCosts() {
  const std::vector<float>& in = Input();
  std::printf(
      "\ncast-error telemetry, median of 21 back-to-back pairs: every element measured, and "
      "sampled as the shard measures by default (rare elements exact, 1 in %u vectors of the "
      "rest; goal <= 10%%)\n%-24s %9s %9s\n",
      kSampleEvery, "dtype", "exact", "sampled");
  bool met = true;
  const auto row = [&](const std::string& name, auto&& cast) {
    const double exact = PairedTelemetryCost(1, cast);
    const double sampled = PairedTelemetryCost(kSampleEvery, cast);
    std::printf("%-24s %+8.1f%% %+8.1f%%\n", name.c_str(), exact * 100, sampled * 100);
    met = met && sampled <= 0.10;
  };
  for (DType to : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<uint16_t> out(kElements);
    row(std::string(DTypeShortName(to)), [&](CastError* error) {
      if (!CastFromF32(in.data(), out.data(), kElements, to, Fp16Overflow::kError, error).ok()) {
        std::abort();  // Input() holds no value that overflows float16
      }
    });
  }
  for (Fp8Format format : {Fp8Format::kE4M3FN, Fp8Format::kE5M2}) {
    constexpr size_t kFp8Block = 128;
    std::vector<uint8_t> out(kElements);
    std::vector<float> scales(Fp8BlockCount(kElements, kFp8Block));
    row(std::string(Fp8FormatName(format)),
        [&](CastError* error) { QuantizeFp8(in, kFp8Block, format, out, scales, error); });
  }
  std::printf("sampled telemetry goal (<= 10%% for every dtype) %s\n", met ? "met" : "NOT met");
}

// Prints as usual, and keeps each benchmark's median throughput for the table.
// --smoke (bench/smoke.py): a few hundredths of a second a repetition,
// three of them, for a regression guard that runs in seconds.
bool smoke = false;

class TableReporter : public benchmark::ConsoleReporter {
 public:
  TableReporter() : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_ColorTabular : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Aggregate || run.aggregate_name != "median") continue;
      if (auto it = run.counters.find("bytes_per_second"); it != run.counters.end()) {
        medians_.emplace_back(run.run_name.function_name, it->second.value / 1e9);
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  // Variants in the order they ran, memcpy (the first) as the baseline.
  void PrintTable() const {
    if (medians_.empty() || medians_.front().first != "memcpy") return;
    const double baseline = medians_.front().second;
    std::printf("\nfp32 bytes per second, median of %d\n%-28s %8s %10s\n", smoke ? 3 : 5, "variant",
                "GB/s", "vs memcpy");
    for (const auto& [name, gb_per_s] : medians_) {
      std::printf("%-28s %8.2f %9.2fx\n", name.c_str(), gb_per_s, gb_per_s / baseline);
    }
    for (const char* rows : {"shard_cast", "shard_cast_cached"}) {
      for (const char* dtype : {"bf16", "f16"}) {
        const double plain = Median(absl::StrCat(rows, "/", dtype));
        const double measured = Median(absl::StrCat(rows, "/", dtype, "+error"));
        if (plain > 0 && measured > 0) {
          std::printf("cast-error telemetry costs %.1f%% of the %s cast%s (goal <= 10%%)\n",
                      (plain / measured - 1) * 100, dtype,
                      std::string_view(rows) == "shard_cast" ? "" : ", from cache");
        }
      }
    }
  }

  // The digest's cost beside the cast's, per byte served (both rows count
  // the same fp32 input bytes): what one GetLayerDigest of a version adds
  // to the shard's one cast of it for every reader.
  void PrintDigestCost() const {
    const double cast = Median("shard_cast/bf16");
    const double digest = Median("slice_digest_of_bf16");
    if (cast > 0 && digest > 0) {
      std::printf("slice digest: %.2f GB/s of bf16 served, %.2fx the cast's time per byte\n",
                  digest / 2, cast / digest);
    }
  }

  // Whether the filter let the shard's casts run: the paired figure follows them.
  bool RanShardCasts() const { return Median("shard_cast/bf16+error") > 0; }

 private:
  double Median(const std::string& name) const {
    for (const auto& [run, gb_per_s] : medians_) {
      if (run == name) return gb_per_s;
    }
    return 0;
  }

  std::vector<std::pair<std::string, double>> medians_;  // (benchmark, GB/s), 1 GB = 1e9 bytes
};

void Register(benchmark::internal::Benchmark* benchmark) {
  benchmark->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->MinTime(smoke ? 0.03 : 0.3)
      ->Repetitions(smoke ? 3 : 5)
      ->ReportAggregatesOnly(true);
}

}  // namespace
}  // namespace layercast

int main(int argc, char** argv) {
  using namespace layercast;
  // Taken out before Google Benchmark reads the rest.
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) != "--smoke") continue;
    smoke = true;
    std::copy(argv + i + 1, argv + argc, argv + i);
    --argc;
    break;
  }
  Register(benchmark::RegisterBenchmark("memcpy", BM_Memcpy));
  for (CastIsa isa : SupportedCastIsas()) {
    const std::string name(CastIsaName(isa));
    Register(benchmark::RegisterBenchmark(absl::StrCat("f32_to_bf16/", name).c_str(), BM_F32ToBF16,
                                          isa));
    Register(
        benchmark::RegisterBenchmark(absl::StrCat("f32_to_f16/", name).c_str(), BM_F32ToF16, isa));
    Register(benchmark::RegisterBenchmark(absl::StrCat("bf16_to_f32/", name).c_str(), BM_Widen, isa,
                                          true));
    Register(benchmark::RegisterBenchmark(absl::StrCat("f16_to_f32/", name).c_str(), BM_Widen, isa,
                                          false));
  }
  for (DType to : {DType::kBFloat16, DType::kFloat16}) {
    const std::string name = absl::StrCat("shard_cast/", DTypeShortName(to));
    Register(benchmark::RegisterBenchmark(name.c_str(), BM_ShardCast, to, false, kElements));
    Register(
        benchmark::RegisterBenchmark((name + "+error").c_str(), BM_ShardCast, to, true, kElements));
  }
  // The shard casts a chunk in blocks of 24 Ki elements (server/casting/chunk_caster.cc).
  constexpr size_t kCachedPiece = 24 << 10;
  for (DType to : {DType::kBFloat16, DType::kFloat16}) {
    const std::string name = absl::StrCat("shard_cast_cached/", DTypeShortName(to));
    Register(benchmark::RegisterBenchmark(name.c_str(), BM_ShardCast, to, false, kCachedPiece));
    Register(benchmark::RegisterBenchmark((name + "+error").c_str(), BM_ShardCast, to, true,
                                          kCachedPiece));
  }
  for (Fp8Format format : {Fp8Format::kE4M3FN, Fp8Format::kE5M2}) {
    for (CastIsa isa : SupportedCastIsas()) {
      if (isa == CastIsa::kAvx512Bf16) continue;  // kAvx512's fp8 kernel
      const std::string name = absl::StrCat(Fp8FormatName(format), "/", CastIsaName(isa));
      Register(benchmark::RegisterBenchmark(name.c_str(), BM_QuantizeFp8, format, isa, false));
      Register(benchmark::RegisterBenchmark((name + "+error").c_str(), BM_QuantizeFp8, format, isa,
                                            true));
    }
  }
  for (CastIsa isa : SupportedCastIsas()) {
    // kAvx512Bf16 measures with kAvx512's kernel.
    if (isa == CastIsa::kScalar || isa == CastIsa::kAvx512Bf16) continue;
    for (DType to : {DType::kBFloat16, DType::kFloat16}) {
      Register(benchmark::RegisterBenchmark(
          absl::StrCat("measure_", DTypeShortName(to), "/", CastIsaName(isa)).c_str(), BM_Measure,
          isa, to));
    }
  }
  for (Crc32cPath path : SupportedCrc32cPaths()) {
    if (path == Crc32cPath::kTable) continue;  // a byte at a time: not a contender
    Register(benchmark::RegisterBenchmark(absl::StrCat("crc32c_of_bf16/", PathName(path)).c_str(),
                                          BM_Crc32cOfBf16, path));
    Register(
        benchmark::RegisterBenchmark(absl::StrCat("crc32c_of_bf16_blocks/", PathName(path)).c_str(),
                                     BM_Crc32cOfBf16Blocks, path));
  }
  Register(benchmark::RegisterBenchmark("slice_digest_of_bf16", BM_SliceDigestOfBf16));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  Input();  // filled once, before any timing
  // The dispatcher measures the kernels at first use (core/cast.h), which
  // must not land inside shard_cast's timing.
  std::printf("dispatched: %s\n", SelectedCastIsa().Describe().c_str());
  TableReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintTable();
  reporter.PrintDigestCost();
  if (reporter.RanShardCasts()) PrintPairedTelemetryCosts();
  benchmark::Shutdown();
  return 0;
}
