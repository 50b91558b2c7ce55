#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace layercast {

enum class OptimizerKind {
  kSgd,    // torch.optim.SGD
  kAdamW,  // torch.optim.AdamW
};

absl::string_view OptimizerKindName(OptimizerKind kind);  // "sgd" or "adamw"

// The hyper-parameters of one tensor, resolved from an OptimizerSpec by
// OptimizerSpec::HyperFor. Defaults are torch's. Fields of the other kind are
// left at their defaults and ignored.
struct OptimizerHyper {
  double lr = 0;  // peak learning rate, before the schedule; >= 0
  // SGD's default is 0, AdamW's 1e-2 (set by the parser); >= 0. SGD adds
  // weight_decay * param to the gradient, AdamW multiplies the param by
  // (1 - lr * weight_decay), as torch does.
  double weight_decay = 0;

  // SGD only. dampening is always 0 (the only value layercast supports).
  double momentum = 0;    // >= 0; 0 keeps no momentum buffer
  bool nesterov = false;  // requires momentum > 0

  // AdamW only.
  double beta1 = 0.9;    // in [0, 1)
  double beta2 = 0.999;  // in [0, 1)
  double eps = 1e-8;     // >= 0

  friend bool operator==(const OptimizerHyper&, const OptimizerHyper&) = default;
};

// An optimizer for a model's fp32 master weights, written as text:
//
//   spec      := kind ':' pairs (';' override)*
//   kind      := 'sgd' | 'adamw'
//   pairs     := key '=' value (',' key '=' value)*
//   override  := glob ':' pairs
//
// Keys of the first part:
//   lr            required; >= 0
//   weight_decay  >= 0 (default sgd 0, adamw 0.01)
//   sgd only:     momentum (>= 0, default 0), nesterov (0/1/false/true,
//                 default false; needs momentum > 0), dampening (only 0)
//   adamw only:   beta1 (default 0.9), beta2 (default 0.999), both in [0, 1);
//                 eps (>= 0, default 1e-8)
//   warmup_steps  integer, default 0: the lr rises linearly from 0
//   decay_steps   integer, default 0: after warm-up the lr follows a cosine
//                 from lr down to min_lr over this many steps, then stays
//                 at min_lr; 0 keeps it at lr
//   min_lr        in [0, lr], default 0; only with decay_steps
//   clip          > 0: clip the global gradient norm to this (see ClipScale
//                 in core/optimizer.h); absent: no clipping
//
// An override sets the per-tensor keys (lr, weight_decay, and momentum and
// nesterov for sgd or beta1, beta2 and eps for adamw) of every tensor whose
// whole name matches its glob (platform/glob.h), on top of the first part.
// As in Policy, the FIRST matching override wins and a tensor gets only that
// override's keys: "adamw:lr=1e-3;*norm*:weight_decay=0;*:lr=1e-4" gives
// "layers.0.norm.weight" weight_decay 0 and lr 1e-3.
//
// Numbers are what strtod accepts (finite only); no spaces anywhere; a key
// may appear once per part. Immutable value type; thread-safe for
// concurrent reads.
class OptimizerSpec {
 public:
  // The per-tensor keys one override sets; absent ones come from the first
  // part.
  struct Override {
    std::string glob;
    std::optional<double> lr, weight_decay, momentum, beta1, beta2, eps;
    std::optional<bool> nesterov;
    friend bool operator==(const Override&, const Override&) = default;
  };

  // INVALID_ARGUMENT naming the offending key or value and what is valid.
  static absl::StatusOr<OptimizerSpec> Parse(absl::string_view text);

  OptimizerKind kind() const { return kind_; }
  // The hyper-parameters of a tensor that no override matches.
  const OptimizerHyper& defaults() const { return defaults_; }
  const std::vector<Override>& overrides() const { return overrides_; }
  uint64_t warmup_steps() const { return warmup_steps_; }
  uint64_t decay_steps() const { return decay_steps_; }
  double min_lr() const { return min_lr_; }
  // The max global gradient norm, if clipping is on.
  std::optional<double> clip() const { return clip_; }

  // The hyper-parameters of the tensor named `tensor_name`.
  OptimizerHyper HyperFor(absl::string_view tensor_name) const;

  // The learning rate at 1-based `step` for a tensor whose peak lr is
  // `hyper.lr`: hyper.lr * step / warmup_steps while step <= warmup_steps;
  // then, with s = step - warmup_steps, while s <= decay_steps,
  // hyper.lr * (r + (1 - r) * (1 + cos(pi * s / decay_steps)) / 2) where
  // r = min_lr / defaults().lr (0 when that lr is 0); then hyper.lr * r.
  // So min_lr is the floor of the default lr, and a tensor whose lr is
  // overridden decays to the same fraction of its own lr. Step 0 gives 0.
  double LearningRate(const OptimizerHyper& hyper, uint64_t step) const;

  // Canonical form, which Parse() maps back to an equal spec: the kind, lr,
  // then every per-tensor key of the kind, then the schedule and clip keys
  // that are set, then the overrides with their set keys, numbers in their
  // shortest round-trip form, e.g.
  // "adamw:lr=3e-04,weight_decay=0.1,beta1=0.9,beta2=0.95,eps=1e-08;*norm*:weight_decay=0".
  std::string ToString() const;

  friend bool operator==(const OptimizerSpec&, const OptimizerSpec&) = default;

 private:
  OptimizerSpec() = default;

  OptimizerKind kind_ = OptimizerKind::kSgd;
  OptimizerHyper defaults_;
  std::vector<Override> overrides_;
  uint64_t warmup_steps_ = 0;
  uint64_t decay_steps_ = 0;
  double min_lr_ = 0;
  std::optional<double> clip_;
};

}  // namespace layercast
