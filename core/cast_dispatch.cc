#include "core/cast_dispatch.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstring>
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
    casts.push_back(absl::StrCat(CastKindName(choice.kind), " ", CastIsaName(choice.isa)));
  }
  return absl::StrCat("by CPUID, ", cpu, " (", row, "): ", absl::StrJoin(casts, "; "));
}

namespace {

// What each row of the table prefers for each cast, in kCastKinds order;
// a CPU that cannot run a preference gets the widest narrower variant it
// runs (internal::SelectFor).
struct CpuRow {
  const char* name;
  const char* vendor;  // CPUID leaf 0's vendor string
  unsigned family_min, family_max;
  CastIsa prefer[std::size(kCastKinds)];
};

// Rows are added with a cast_bench figure from the CPU they name, never
// from a guess: a CPU without a row runs the widest variant it has at every
// cast, which since the AVX-512 kernels align their loads (docs/
// performance.md, "Loads that straddle cache lines") is as fast as any on
// the CPUs measured. A row names a narrower variant where one is clearly
// faster there. cast_bench on an EPYC Zen 5 (family 0x1a), GB/s of fp32:
// f32_to_bf16 avx2 28.3, avx512 28.2, avx512bf16 28.0; f32_to_f16 avx2
// 31.0, avx512 29.4; bf16_to_f32 avx2 28.9, avx512 28.1; f16_to_f32 avx2
// 27.5, avx512 28.1: bound by memory, so a fixed pick costs nothing, while
// a pick by timing at start differed from start to start and shard to
// shard.
constexpr CpuRow kCpuRows[] = {
    {"AMD Zen 5",
     "AuthenticAMD",
     0x1a,
     0x1a,
     {CastIsa::kAvx512Bf16, CastIsa::kAvx512, CastIsa::kAvx512, CastIsa::kAvx512}},
};
constexpr CpuRow kWidestRow = {
    "no row: the widest it runs",
    "",
    0,
    0,
    {CastIsa::kAvx512Bf16, CastIsa::kAvx512Bf16, CastIsa::kAvx512Bf16, CastIsa::kAvx512Bf16}};

internal::CpuModel ThisCpu() {
  internal::CpuModel cpu;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return cpu;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  cpu.vendor = vendor;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return cpu;
  // The display family and model, as the vendors' manuals compose them.
  const unsigned base_family = (eax >> 8) & 0xF;
  const unsigned base_model = (eax >> 4) & 0xF;
  cpu.family = base_family == 0xF ? base_family + ((eax >> 20) & 0xFF) : base_family;
  cpu.model = base_family == 0xF || base_family == 0x6 ? (((eax >> 16) & 0xF) << 4) | base_model
                                                       : base_model;
  return cpu;
}

absl::Mutex g_selection_mu;
CastIsaSelection* g_selection ABSL_GUARDED_BY(g_selection_mu) = nullptr;
// The selection as kernels, or null before it: the casts' fast path reads
// only this. Kept for the process's life, like g_selection.
std::atomic<const Kernels*> g_kernels{nullptr};

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
    // Kept for the process's life.
    g_selection = new CastIsaSelection(internal::SelectFor(ThisCpu(), SupportedCastIsas()));
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
  g_selection = new CastIsaSelection{.chosen = true};
  for (CastKind kind : kCastKinds) g_selection->choices.push_back({kind, isa});
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

CastIsaSelection SelectFor(const CpuModel& cpu, const std::vector<CastIsa>& runs) {
  const CpuRow* row = &kWidestRow;
  for (const CpuRow& candidate : kCpuRows) {
    if (cpu.vendor == candidate.vendor && cpu.family >= candidate.family_min &&
        cpu.family <= candidate.family_max) {
      row = &candidate;
      break;
    }
  }
  CastIsaSelection selection;
  selection.cpu =
      absl::StrFormat("%s family 0x%x model 0x%x",
                      cpu.vendor.empty() ? "unknown vendor" : cpu.vendor, cpu.family, cpu.model);
  selection.row = row->name;
  for (size_t k = 0; k < std::size(kCastKinds); ++k) {
    // The widest variant the CPU runs no wider than the row's preference
    // (variants are declared narrowest first).
    CastIsa picked = CastIsa::kScalar;
    for (CastIsa isa : runs) {
      if (isa <= row->prefer[k]) picked = std::max(picked, isa);
    }
    selection.choices.push_back({kCastKinds[k], picked});
  }
  return selection;
}

}  // namespace layercast::internal
