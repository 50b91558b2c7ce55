#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/optimizer_spec.h"

namespace layercast {

// Floats of optimizer state kept per parameter element: SGD 1 with momentum
// (the momentum buffer) and 0 without, AdamW 2 (exp_avg and exp_avg_sq).
uint64_t StateFloatsPerElement(OptimizerKind kind, const OptimizerHyper& hyper);

// The factor every gradient is multiplied by when clipping to `max_norm` a
// set of gradients whose global L2 norm is `total_norm`: min(1, max_norm /
// (total_norm + 1e-6)), computed as torch.nn.utils.clip_grad_norm_ does in
// torch 1.13.1, with float32 tensor ops: total_norm rounded to float (torch
// holds it in a float32 tensor), + float(1e-6), reciprocal, * float(max_norm),
// clamped to at most 1. A NaN norm gives NaN and an infinite one 0, as there.
// Multiply each gradient element by the result in float to finish the clip.
float ClipScale(double total_norm, double max_norm);

// The optimizer of one fp32 tensor (or of a slice of it, which updates the
// same bits as the whole would: every update is elementwise): its
// hyper-parameters, its step count and its fp32 state buffers, owned here and
// sized to the slice at construction.
//
// Step() updates the parameters bit for bit as torch 1.13.1's
// `torch.optim.SGD(..., foreach=False)` / `torch.optim.AdamW(...,
// foreach=False)` do on CPU, given the same lr in the param group before each
// step; tests/core/optimizer_torch_test.cc checks this against torch's AVX2
// kernels (torch.__config__ says "CPU capability usage: AVX2"; its DEFAULT
// and AVX-512 kernels are unchecked). Scalars
// are computed in double as torch's Python code does, then rounded to float as
// torch's kernels do.
//
// Sees a step's parameters a block at a time, just before and just after
// the block is updated, while the block is still in cache: what the shard's
// change log compares (server/serving/change_log.h) costs no second pass over
// memory. `offset` is the block's first element in the tensor (slice).
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  virtual void Before(size_t offset, std::span<const float> block) = 0;
  virtual void After(size_t offset, std::span<const float> block) = 0;
};

// Not thread-safe; distinct instances are independent.
class TensorOptimizer {
 public:
  // `hyper` as resolved by OptimizerSpec::HyperFor (so already valid).
  TensorOptimizer(OptimizerKind kind, const OptimizerHyper& hyper, size_t size);

  // One step with learning rate `lr` (OptimizerSpec::LearningRate at this
  // step): updates `param` in place from `grad`. INVALID_ARGUMENT, changing
  // nothing, when `param` or `grad` does not hold size() elements or `lr` is
  // negative or not finite.
  // With `observer`, the update runs in blocks of kObservedBlock elements,
  // each shown to it before and after; the bits are the same either way.
  absl::Status Step(double lr, std::span<float> param, std::span<const float> grad,
                    StepObserver* observer = nullptr);
  // A block's fp32 parameters, gradients and state, and the observer's two
  // compute-dtype copies of it, stay well inside a core's L2 cache.
  static constexpr size_t kObservedBlock = 4096;

  OptimizerKind kind() const { return kind_; }
  const OptimizerHyper& hyper() const { return hyper_; }
  size_t size() const { return size_; }
  // Steps taken so far (torch's state['step']).
  uint64_t steps() const { return steps_; }

  // SGD's momentum buffer; empty without momentum. Before the first step it
  // holds zeros (torch has no buffer yet; the first step copies into it).
  std::span<const float> momentum_buffer() const;
  // AdamW's running averages of the gradient and of its square; empty for SGD.
  std::span<const float> exp_avg() const;
  std::span<const float> exp_avg_sq() const;

  // Every state buffer, named as torch's state_dict names it:
  // "momentum_buffer" (SGD with momentum), "exp_avg" and "exp_avg_sq"
  // (AdamW); none for plain SGD. What a checkpoint saves.
  std::vector<std::pair<const char*, std::span<const float>>> StateBuffers() const;
  // Takes back what StateBuffers() gave, in its order, and the step count:
  // the optimizer then continues bit for bit as the one that was saved.
  // INVALID_ARGUMENT, changing nothing, for the wrong number or size of
  // buffers.
  absl::Status Restore(uint64_t steps, const std::vector<std::vector<float>>& buffers);

 private:
  // Update elements [begin, end) of `param` (the whole tensor's).
  void SgdStep(double lr, float* param, const float* grad, size_t begin, size_t end);
  void AdamWStep(double lr, float* param, const float* grad, size_t begin, size_t end);

  OptimizerKind kind_;
  OptimizerHyper hyper_;
  size_t size_;
  uint64_t steps_ = 0;
  std::vector<float> first_;   // SGD momentum buffer or AdamW exp_avg
  std::vector<float> second_;  // AdamW exp_avg_sq
};

}  // namespace layercast
