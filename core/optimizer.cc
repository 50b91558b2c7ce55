#include "core/optimizer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

// How torch 1.13.1 computes each op on CPU float32 (AVX2 kernels, read in
// ATen and confirmed bit for bit against Debian's python3-torch, in both the
// vectorized body and the scalar tail of each loop, at 1 and 2 threads):
//
//   a.add(b, alpha=s)        fma(b, float(s), a)   (ufunc::add is vec::fmadd;
//                                                   its scalar tail is fused too)
//   a.mul(s), a * s          a * float(s)
//   a.addcmul(b, c, value=s) fma(float(s) * b, c, a)  (written a + s*b*c, fused)
//   a.addcdiv(b, c, value=s) a + (float(s) * b) / c   (nothing to fuse)
//   a / s                    a / float(s)          (a true division, not a
//                                                   multiply by 1/s)
//   a.sqrt()                 sqrtf(a)              (correctly rounded)
//   a + s                    a + float(s)
//
// Python scalars are doubles; the kernels round them to float once. So this
// file computes scalars in double exactly as torch's Python code does and
// uses std::fma exactly where torch fuses. core/CMakeLists.txt compiles it
// with -ffp-contract=off so the compiler fuses nothing else (GCC's default,
// -ffp-contract=fast, would fuse `a * b + c` wherever FMA instructions are
// enabled).

namespace layercast {

uint64_t StateFloatsPerElement(OptimizerKind kind, const OptimizerHyper& hyper) {
  if (kind == OptimizerKind::kAdamW) return 2;
  return hyper.momentum != 0 ? 1 : 0;
}

float ClipScale(double total_norm, double max_norm) {
  // Python's `max_norm / tensor` is Tensor.__rtruediv__, i.e.
  // tensor.reciprocal() * max_norm.
  const float denominator = static_cast<float>(total_norm) + static_cast<float>(1e-6);
  const float coefficient = (1.0f / denominator) * static_cast<float>(max_norm);
  // With the NaN first, std::min returns it, as torch.clamp propagates NaN.
  return std::min(coefficient, 1.0f);
}

TensorOptimizer::TensorOptimizer(OptimizerKind kind, const OptimizerHyper& hyper, size_t size)
    : kind_(kind), hyper_(hyper), size_(size) {
  const uint64_t floats = StateFloatsPerElement(kind, hyper);
  if (floats >= 1) first_.assign(size, 0.0f);
  if (floats >= 2) second_.assign(size, 0.0f);
}

std::span<const float> TensorOptimizer::momentum_buffer() const {
  return kind_ == OptimizerKind::kSgd ? std::span<const float>(first_) : std::span<const float>();
}

std::span<const float> TensorOptimizer::exp_avg() const {
  return kind_ == OptimizerKind::kAdamW ? std::span<const float>(first_) : std::span<const float>();
}

std::span<const float> TensorOptimizer::exp_avg_sq() const { return second_; }

std::vector<std::pair<const char*, std::span<const float>>> TensorOptimizer::StateBuffers() const {
  std::vector<std::pair<const char*, std::span<const float>>> buffers;
  if (kind_ == OptimizerKind::kSgd) {
    if (StateFloatsPerElement(kind_, hyper_) == 1) buffers.emplace_back("momentum_buffer", first_);
  } else {
    buffers.emplace_back("exp_avg", first_);
    buffers.emplace_back("exp_avg_sq", second_);
  }
  return buffers;
}

absl::Status TensorOptimizer::Restore(uint64_t steps,
                                      const std::vector<std::vector<float>>& buffers) {
  std::vector<std::vector<float>*> mine = {&first_, &second_};
  mine.resize(StateFloatsPerElement(kind_, hyper_));
  if (buffers.size() != mine.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the optimizer keeps ", mine.size(), " state buffer(s); ", buffers.size(), " were given"));
  }
  for (const std::vector<float>& buffer : buffers) {
    if (buffer.size() != size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("a state buffer of ", buffer.size(), " values for a tensor of ", size_));
    }
  }
  for (size_t i = 0; i < buffers.size(); ++i) *mine[i] = buffers[i];
  steps_ = steps;
  return absl::OkStatus();
}

// Both steps are cloned for x86-64-v3 (AVX2 and FMA), picked at load time
// on CPUs that have it: std::fma becomes one instruction instead of a libm
// call, and the loops vectorise. The bits are the same either way: an FMA
// rounds once whether the hardware or libm computes it, and -ffp-contract=off
// keeps the compiler from fusing anything else. Defined before Step, their
// first use, as clang requires of multiversioned functions.
#define LAYERCAST_OPTIMIZER_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))

LAYERCAST_OPTIMIZER_CLONES
void TensorOptimizer::SgdStep(double lr, float* param, const float* grad, size_t begin,
                              size_t end) {
  const bool decay = hyper_.weight_decay != 0;
  const bool momentum = hyper_.momentum != 0;
  const bool first_step = steps_ == 0;
  const float weight_decay = static_cast<float>(hyper_.weight_decay);
  const float momentum_f = static_cast<float>(hyper_.momentum);
  const float minus_lr = static_cast<float>(-lr);
  for (size_t i = begin; i < end; ++i) {
    float d_p = grad[i];
    if (decay) d_p = std::fma(param[i], weight_decay, d_p);  // d_p.add(param, alpha=wd)
    if (momentum) {
      float& buf = first_[i];
      // buf.mul_(momentum).add_(d_p, alpha=1 - dampening): with alpha 1 the
      // fused add rounds once, like a plain add.
      buf = first_step ? d_p : buf * momentum_f + d_p;
      d_p = hyper_.nesterov ? std::fma(buf, momentum_f, d_p) : buf;
    }
    param[i] = std::fma(d_p, minus_lr, param[i]);  // param.add_(d_p, alpha=-lr)
  }
}

// torch.optim.adamw._single_tensor_adamw, amsgrad off.
LAYERCAST_OPTIMIZER_CLONES
void TensorOptimizer::AdamWStep(double lr, float* param, const float* grad, size_t begin,
                                size_t end) {
  // As in Python: `step` is state['step'].item(), a float, and `**` is C's pow.
  const double step = static_cast<double>(steps_ + 1);
  const double bias_correction1 = 1 - std::pow(hyper_.beta1, step);
  const double bias_correction2 = 1 - std::pow(hyper_.beta2, step);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);

  const float decay = static_cast<float>(1 - lr * hyper_.weight_decay);
  const float beta1 = static_cast<float>(hyper_.beta1);
  const float one_minus_beta1 = static_cast<float>(1 - hyper_.beta1);
  const float beta2 = static_cast<float>(hyper_.beta2);
  const float one_minus_beta2 = static_cast<float>(1 - hyper_.beta2);
  const float minus_step_size = static_cast<float>(-step_size);
  const float bias_correction2_sqrt_f = static_cast<float>(bias_correction2_sqrt);
  const float eps = static_cast<float>(hyper_.eps);
  // Distinct buffers: __restrict lets the loop vectorise without alias checks.
  float* __restrict const param_p = param;
  const float* __restrict const grad_p = grad;
  float* __restrict const first_p = first_.data();
  float* __restrict const second_p = second_.data();
  for (size_t i = begin; i < end; ++i) {
    const float g = grad_p[i];
    const float p = param_p[i] * decay;                                // param.mul_(1 - lr * wd)
    const float m = std::fma(g, one_minus_beta1, first_p[i] * beta1);  // .add_(grad, alpha=1-b1)
    const float v = std::fma(one_minus_beta2 * g, g, second_p[i] * beta2);  // .addcmul_(g, g, 1-b2)
    const float denom = std::sqrt(v) / bias_correction2_sqrt_f + eps;
    param_p[i] = p + (minus_step_size * m) / denom;  // param.addcdiv_(m, denom, value=-step_size)
    first_p[i] = m;
    second_p[i] = v;
  }
}

absl::Status TensorOptimizer::Step(double lr, std::span<float> param, std::span<const float> grad,
                                   StepObserver* observer) {
  if (param.size() != size_ || grad.size() != size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer step: param has ", param.size(), " elements and grad ", grad.size(),
                     ", but this tensor's optimizer state holds ", size_));
  }
  if (!std::isfinite(lr) || lr < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer step: lr ", lr, " is not a finite number >= 0"));
  }
  const auto update = [&](size_t begin, size_t end) {
    if (kind_ == OptimizerKind::kSgd) {
      SgdStep(lr, param.data(), grad.data(), begin, end);
    } else {
      AdamWStep(lr, param.data(), grad.data(), begin, end);
    }
  };
  if (observer == nullptr) {
    update(0, size_);
  } else {
    for (size_t begin = 0; begin < size_; begin += kObservedBlock) {
      const size_t end = std::min(size_, begin + kObservedBlock);
      observer->Before(begin, param.subspan(begin, end - begin));
      update(begin, end);
      observer->After(begin, param.subspan(begin, end - begin));
    }
  }
  ++steps_;
  return absl::OkStatus();
}

// torch.optim.sgd._single_tensor_sgd, dampening 0.

}  // namespace layercast
