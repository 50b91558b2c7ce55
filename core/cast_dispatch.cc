#include "core/cast_dispatch.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/cast_kernels.h"

namespace layercast {

using internal::Kernels;
using internal::KernelsFor;

namespace {

constexpr Kernels kScalarKernels = {internal::F32ToBF16Scalar, internal::F32ToF16Scalar,
                                    internal::BF16ToF32Scalar, internal::F16ToF32Scalar};
constexpr Kernels kAvx2Kernels = {internal::F32ToBF16Avx2, internal::F32ToF16Avx2,
                                  internal::BF16ToF32Avx2, internal::F16ToF32Avx2};
constexpr Kernels kAvx512Kernels = {internal::F32ToBF16Avx512, internal::F32ToF16Avx512,
                                    internal::BF16ToF32Avx512, internal::F16ToF32Avx512};
constexpr Kernels kAvx512Bf16Kernels = {internal::F32ToBF16Avx512Bf16, internal::F32ToF16Avx512,
                                        internal::BF16ToF32Avx512, internal::F16ToF32Avx512};

// Every variant, in the order SupportedCastIsas lists them.
constexpr CastIsa kAllIsas[] = {CastIsa::kScalar, CastIsa::kAvx2, CastIsa::kAvx512,
                                CastIsa::kAvx512Bf16};

// F16C from CPUID: clang 14's __builtin_cpu_supports does not know "f16c".
// Its registers are the AVX ones, whose OS support the "avx2" check includes.
bool CpuHasF16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

// AVX512_BF16 is CPUID leaf 7, subleaf 1, EAX bit 5; GCC 12 and clang 14
// name it differently in __builtin_cpu_supports, so it is read here. Its
// registers are the AVX-512 ones, whose OS support the "avx512f" check
// includes.
bool CpuHasAvx512Bf16() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 && (eax & (1u << 5)) != 0;
}

// Beyond the features each variant is named after, this also asks for every
// set its file is compiled with (core/CMakeLists.txt), since the compiler may
// use any of them there. The compiler's checks include the OS saving the
// registers.
bool CpuRuns(CastIsa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case CastIsa::kScalar:
      return true;
    case CastIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c();
    case CastIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && CpuHasF16c();
    case CastIsa::kAvx512Bf16:
      return CpuRuns(CastIsa::kAvx512) && CpuHasAvx512Bf16();
  }
  return false;
}

}  // namespace

bool internal::CpuRunsIsa(CastIsa isa) { return CpuRuns(isa); }

const Kernels& internal::KernelsFor(CastIsa isa) {
  static const bool avx2 = CpuRuns(CastIsa::kAvx2);
  static const bool avx512 = CpuRuns(CastIsa::kAvx512);
  static const bool avx512_bf16 = CpuRuns(CastIsa::kAvx512Bf16);
  if (isa == CastIsa::kAvx512Bf16 && avx512_bf16) return kAvx512Bf16Kernels;
  if (isa == CastIsa::kAvx512 && avx512) return kAvx512Kernels;
  if (isa == CastIsa::kAvx2 && avx2) return kAvx2Kernels;
  return kScalarKernels;
}

absl::string_view CastIsaName(CastIsa isa) {
  switch (isa) {
    case CastIsa::kScalar:
      return "scalar";
    case CastIsa::kAvx2:
      return "avx2";
    case CastIsa::kAvx512:
      return "avx512";
    case CastIsa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

const std::vector<CastIsa>& SupportedCastIsas() {
  static const std::vector<CastIsa>* const isas = [] {
    auto* supported = new std::vector<CastIsa>;
    for (CastIsa isa : kAllIsas) {
      if (CpuRuns(isa)) supported->push_back(isa);
    }
    return supported;
  }();
  return *isas;
}

absl::string_view CastKindName(CastKind kind) {
  switch (kind) {
    case CastKind::kF32ToBF16:
      return "f32_to_bf16";
    case CastKind::kF32ToF16:
      return "f32_to_f16";
    case CastKind::kBF16ToF32:
      return "bf16_to_f32";
    case CastKind::kF16ToF32:
      return "f16_to_f32";
  }
  return "unknown";
}

std::string CastIsaSelection::Summary() const {
  const bool one = std::all_of(choices.begin(), choices.end(),
                               [&](const Choice& c) { return c.isa == choices.front().isa; });
  if (one && !choices.empty()) return std::string(CastIsaName(choices.front().isa));
  std::vector<std::string> parts;
  for (const Choice& choice : choices) {
    parts.push_back(absl::StrCat(CastKindName(choice.kind), "=", CastIsaName(choice.isa)));
  }
  return absl::StrJoin(parts, ",");
}

std::string CastIsaSelection::Describe() const {
  if (chosen) return absl::StrCat(Summary(), " (--cast-isa)");
  std::vector<std::string> casts;
  for (const Choice& choice : choices) {
    std::vector<std::string> measured;
    for (const auto& [isa, gbps] : choice.measured) {
      measured.push_back(absl::StrFormat("%s %.1f", CastIsaName(isa), gbps));
    }
    casts.push_back(absl::StrCat(CastKindName(choice.kind), " ", CastIsaName(choice.isa),
                                 measured.empty() ? "" : " (", absl::StrJoin(measured, ", "),
                                 measured.empty() ? "" : " GB/s)"));
  }
  return absl::StrCat(absl::StrFormat("at each cast the widest of this CPU's within %.0f%% of the "
                                      "fastest: ",
                                      internal::kSameSpeed * 100),
                      absl::StrJoin(casts, "; "));
}

namespace {

absl::Mutex g_selection_mu;
CastIsaSelection* g_selection ABSL_GUARDED_BY(g_selection_mu) = nullptr;
// The selection as kernels, or null before it: the casts' fast path reads
// only this. Kept for the process's life, like g_selection.
std::atomic<const Kernels*> g_kernels{nullptr};

// The kernel of `kind` in `kernels`, as an address: variants that share a
// kernel for a cast are measured once.
const void* KernelOf(const Kernels& kernels, CastKind kind) {
  switch (kind) {
    case CastKind::kF32ToBF16:
      return reinterpret_cast<const void*>(kernels.f32_to_bf16);
    case CastKind::kF32ToF16:
      return reinterpret_cast<const void*>(kernels.f32_to_f16);
    case CastKind::kBF16ToF32:
      return reinterpret_cast<const void*>(kernels.bf16_to_f32);
    case CastKind::kF16ToF32:
      return reinterpret_cast<const void*>(kernels.f16_to_f32);
  }
  return nullptr;
}

// Buffers for measuring: 64 MiB of fp32 (more than a last-level cache holds)
// and its 16-bit cast. Both are written before timing, so no page faults are
// timed.
struct MeasureBuffers {
  static constexpr size_t kElements = 16 << 20;
  std::vector<float> wide = std::vector<float>(kElements);
  std::vector<uint16_t> narrow = std::vector<uint16_t>(kElements);

  MeasureBuffers() {
    // Magnitudes below 64: no float16 overflow, so kError runs to the end.
    for (size_t i = 0; i < kElements; ++i) {
      wide[i] = static_cast<float>(i & 0xFFFF) * (1.0f / 1024) * ((i & 1) != 0 ? -1.0f : 1.0f);
    }
  }

  void Run(const Kernels& kernels, CastKind kind) {
    switch (kind) {
      case CastKind::kF32ToBF16:
        return kernels.f32_to_bf16(wide.data(), narrow.data(), kElements);
      case CastKind::kF32ToF16:
        kernels.f32_to_f16(wide.data(), narrow.data(), kElements, Fp16Overflow::kError);
        return;
      case CastKind::kBF16ToF32:
        return kernels.bf16_to_f32(narrow.data(), wide.data(), kElements);
      case CastKind::kF16ToF32:
        return kernels.f16_to_f32(narrow.data(), wide.data(), kElements);
    }
  }
};

// Times every vector variant with a kernel of its own for each cast. The
// variants take turns, twice, so a burst of another tenant's load slows one
// pass of each rather than all passes of one; the best pass counts. The
// narrowing casts run first: the widening ones read what they wrote.
CastIsaSelection Measure() {
  CastIsaSelection selection;
  for (CastKind kind : kCastKinds) selection.choices.push_back({kind, CastIsa::kScalar, {}});
  std::vector<CastIsa> vector_isas;
  for (CastIsa isa : SupportedCastIsas()) {
    if (isa != CastIsa::kScalar) vector_isas.push_back(isa);
  }
  if (vector_isas.empty()) return selection;  // scalar: nothing to measure
  MeasureBuffers buffers;
  for (CastIsaSelection::Choice& choice : selection.choices) {
    std::vector<CastIsa> candidates;
    std::vector<const void*> seen;
    for (CastIsa isa : vector_isas) {
      const void* kernel = KernelOf(KernelsFor(isa), choice.kind);
      if (std::find(seen.begin(), seen.end(), kernel) != seen.end()) continue;
      seen.push_back(kernel);
      candidates.push_back(isa);
      choice.measured.emplace_back(isa, 0.0);
    }
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t c = 0; c < candidates.size(); ++c) {
        const auto start = std::chrono::steady_clock::now();
        buffers.Run(KernelsFor(candidates[c]), choice.kind);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (seconds > 0) {
          const double gbps = MeasureBuffers::kElements * sizeof(float) / seconds / 1e9;
          choice.measured[c].second = std::max(choice.measured[c].second, gbps);
        }
      }
    }
    choice.isa = internal::PickMeasured(choice.measured);
  }
  return selection;
}

// The kernels `selection` names, one cast at a time.
const Kernels* KernelsOf(const CastIsaSelection& selection) {
  return new Kernels{KernelsFor(selection.For(CastKind::kF32ToBF16)).f32_to_bf16,
                     KernelsFor(selection.For(CastKind::kF32ToF16)).f32_to_f16,
                     KernelsFor(selection.For(CastKind::kBF16ToF32)).bf16_to_f32,
                     KernelsFor(selection.For(CastKind::kF16ToF32)).f16_to_f32};
}

const CastIsaSelection& Select() {
  absl::MutexLock lock(&g_selection_mu);
  if (g_selection == nullptr) {
    g_selection = new CastIsaSelection(Measure());  // kept for the process's life
    g_kernels.store(KernelsOf(*g_selection), std::memory_order_release);
  }
  return *g_selection;
}

}  // namespace

const Kernels& internal::DispatchedKernels() {
  const Kernels* kernels = g_kernels.load(std::memory_order_acquire);
  if (kernels != nullptr) return *kernels;
  Select();
  return *g_kernels.load(std::memory_order_acquire);
}

CastIsa BestCastIsa(CastKind kind) { return SelectedCastIsa().For(kind); }

const CastIsaSelection& SelectedCastIsa() { return Select(); }

absl::Status ChooseCastIsa(CastIsa isa) {
  if (!CpuRuns(isa)) {
    return absl::FailedPreconditionError(
        absl::StrCat("this CPU cannot run the ", CastIsaName(isa), " cast kernels"));
  }
  absl::MutexLock lock(&g_selection_mu);
  if (g_selection != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("the cast kernels were picked already (",
                                                      g_selection->Summary(),
                                                      "): choose before the first cast"));
  }
  g_selection = new CastIsaSelection{true, {}};
  for (CastKind kind : kCastKinds) g_selection->choices.push_back({kind, isa, {}});
  g_kernels.store(KernelsOf(*g_selection), std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<CastIsa> CastIsaFromName(absl::string_view name) {
  for (CastIsa isa : kAllIsas) {
    if (name == CastIsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown cast kernel '", name, "': use scalar, avx2, avx512 or avx512bf16"));
}

}  // namespace layercast

namespace layercast::internal {

CastIsa PickMeasured(const std::vector<std::pair<CastIsa, double>>& measured) {
  double fastest = 0;
  for (const auto& [isa, gbps] : measured) fastest = std::max(fastest, gbps);
  CastIsa picked = measured.front().first;
  for (const auto& [isa, gbps] : measured) {
    if (gbps >= fastest * (1 - kSameSpeed)) picked = isa;
  }
  return picked;
}

}  // namespace layercast::internal
