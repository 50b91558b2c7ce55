#include "core/cast.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/cast_error.h"
#include "core/cast_kernels.h"

namespace layercast {
namespace {

struct Kernels {
  void (*f32_to_bf16)(const float*, uint16_t*, size_t);
  size_t (*f32_to_f16)(const float*, uint16_t*, size_t, Fp16Overflow);
  void (*bf16_to_f32)(const uint16_t*, float*, size_t);
  void (*f16_to_f32)(const uint16_t*, float*, size_t);
};

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

// An isa this CPU cannot run gets the scalar kernels: same bits, no SIGILL.
const Kernels& KernelsFor(CastIsa isa) {
  static const bool avx2 = CpuRuns(CastIsa::kAvx2);
  static const bool avx512 = CpuRuns(CastIsa::kAvx512);
  static const bool avx512_bf16 = CpuRuns(CastIsa::kAvx512Bf16);
  if (isa == CastIsa::kAvx512Bf16 && avx512_bf16) return kAvx512Bf16Kernels;
  if (isa == CastIsa::kAvx512 && avx512) return kAvx512Kernels;
  if (isa == CastIsa::kAvx2 && avx2) return kAvx2Kernels;
  return kScalarKernels;
}

absl::Status OverflowError(const float* src, size_t index) {
  return absl::OutOfRangeError(absl::StrCat("element ", index, " is ", src[index],
                                            ", beyond float16's largest finite value 65504"));
}

// Enough for the bounce buffers of unaligned 16-bit data, small for the stack.
constexpr size_t kBounceElements = 2048;

absl::Status NarrowToF16(const Kernels& kernels, std::span<const float> src,
                         std::span<uint16_t> dst, Fp16Overflow overflow) {
  if (src.size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot cast ", src.size(),
                                                   " float32 elements into room for ", dst.size(),
                                                   ": the sizes must be equal"));
  }
  const size_t done = kernels.f32_to_f16(src.data(), dst.data(), src.size(), overflow);
  if (done != src.size()) return OverflowError(src.data(), done);
  return absl::OkStatus();
}

}  // namespace

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

// The kernels the functions without a CastIsa argument use.
const Kernels& Dispatched() {
  const Kernels* kernels = g_kernels.load(std::memory_order_acquire);
  if (kernels != nullptr) return *kernels;
  Select();
  return *g_kernels.load(std::memory_order_acquire);
}

}  // namespace

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

void CastF32ToBF16(std::span<const float> src, std::span<uint16_t> dst) {
  assert(src.size() == dst.size());
  Dispatched().f32_to_bf16(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

void CastF32ToBF16(std::span<const float> src, std::span<uint16_t> dst, CastIsa isa) {
  assert(src.size() == dst.size());
  KernelsFor(isa).f32_to_bf16(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

absl::Status CastF32ToF16(std::span<const float> src, std::span<uint16_t> dst,
                          Fp16Overflow overflow) {
  return NarrowToF16(Dispatched(), src, dst, overflow);
}

absl::Status CastF32ToF16(std::span<const float> src, std::span<uint16_t> dst,
                          Fp16Overflow overflow, CastIsa isa) {
  return NarrowToF16(KernelsFor(isa), src, dst, overflow);
}

void CastBF16ToF32(std::span<const uint16_t> src, std::span<float> dst) {
  assert(src.size() == dst.size());
  Dispatched().bf16_to_f32(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

void CastBF16ToF32(std::span<const uint16_t> src, std::span<float> dst, CastIsa isa) {
  assert(src.size() == dst.size());
  KernelsFor(isa).bf16_to_f32(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

void CastF16ToF32(std::span<const uint16_t> src, std::span<float> dst) {
  assert(src.size() == dst.size());
  Dispatched().f16_to_f32(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

void CastF16ToF32(std::span<const uint16_t> src, std::span<float> dst, CastIsa isa) {
  assert(src.size() == dst.size());
  KernelsFor(isa).f16_to_f32(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

absl::Status CastFromF32(const float* src, void* dst, size_t count, DType to,
                         Fp16Overflow overflow) {
  return CastFromF32(src, dst, count, to, overflow, nullptr);
}

absl::Status CastFromF32(const float* src, void* dst, size_t count, DType to, Fp16Overflow overflow,
                         CastError* error) {
  if (IsFloat8(to)) {
    return absl::InvalidArgumentError(
        absl::StrCat("casting to ", DTypeName(to),
                     " needs block scales: quantize with QuantizeFp8 (core/fp8.h)"));
  }
  if (to == DType::kFloat32) {
    if (count != 0) std::memcpy(dst, src, count * sizeof(float));
    if (error != nullptr) error->elements += count;
    return absl::OkStatus();
  }
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % alignof(uint16_t) == 0;
  static const bool fused = CpuRuns(CastIsa::kAvx512);
  if (aligned && error != nullptr && fused) {
    // One pass that measures from the registers it casts in: wherever the CPU
    // has AVX-512, whichever variant the plain cast dispatches to (the bits
    // are the same).
    auto* out = static_cast<uint16_t*>(dst);
    CastError lost;  // added to *error only when the whole cast succeeds
    size_t done = count;
    if (to == DType::kBFloat16) {
      internal::F32ToBF16MeasuredAvx512(src, out, count, internal::kBF16Limits, &lost);
    } else {
      done =
          internal::F32ToF16MeasuredAvx512(src, out, count, overflow, internal::kF16Limits, &lost);
    }
    if (done != count) return OverflowError(src, done);
    error->Add(lost);
    return absl::OkStatus();
  }
  const Kernels& kernels = Dispatched();
  // Narrows [0, n) into `out`; returns the first overflowing index or n.
  auto narrow = [&](const float* from, uint16_t* out, size_t n) -> size_t {
    if (to == DType::kBFloat16) {
      kernels.f32_to_bf16(from, out, n);
      return n;
    }
    return kernels.f32_to_f16(from, out, n, overflow);
  };
  if (aligned && error == nullptr) {
    const size_t done = narrow(src, static_cast<uint16_t*>(dst), count);
    return done == count ? absl::OkStatus() : OverflowError(src, done);
  }
  // Pieces: measured while in L1, or bounced, since the kernels store whole
  // uint16_t, which an odd address cannot hold.
  uint16_t bounce[kBounceElements];
  auto* out = static_cast<unsigned char*>(dst);
  CastError lost;  // as above
  for (size_t begin = 0; begin < count; begin += kBounceElements) {
    const size_t n = std::min(kBounceElements, count - begin);
    uint16_t* piece = aligned ? static_cast<uint16_t*>(dst) + begin : bounce;
    const size_t done = narrow(src + begin, piece, n);
    if (error != nullptr && done == n) MeasureCastError(src + begin, piece, n, to, &lost);
    if (!aligned) std::memcpy(out + begin * sizeof(uint16_t), bounce, done * sizeof(uint16_t));
    if (done != n) return OverflowError(src, begin + done);
  }
  if (error != nullptr) error->Add(lost);
  return absl::OkStatus();
}

void CastToF32(const void* src, DType from, float* dst, size_t count) {
  assert(!IsFloat8(from));
  if (from == DType::kFloat32) {
    if (count != 0) std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  const Kernels& kernels = Dispatched();
  const auto widen = from == DType::kBFloat16 ? kernels.bf16_to_f32 : kernels.f16_to_f32;
  if (reinterpret_cast<uintptr_t>(src) % alignof(uint16_t) == 0) {
    widen(static_cast<const uint16_t*>(src), dst, count);
    return;
  }
  uint16_t bounce[kBounceElements];
  const auto* in = static_cast<const unsigned char*>(src);
  for (size_t begin = 0; begin < count; begin += kBounceElements) {
    const size_t n = std::min(kBounceElements, count - begin);
    std::memcpy(bounce, in + begin * sizeof(uint16_t), n * sizeof(uint16_t));
    widen(bounce, dst + begin, n);
  }
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
