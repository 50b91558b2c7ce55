// Our optimizer steps against torch.optim.SGD / torch.optim.AdamW
// (foreach=False) bit for bit, run by tests/core/optimizer_torch_test.py under
// /usr/bin/python3 (Debian's python3-torch; CI installs it).

#include <gtest/gtest.h>

#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/optimizer.h"
#include "core/optimizer_spec.h"
#include "tests/core/torch_check.h"
#include "tests/prerequisite.h"

namespace layercast {
namespace {

using torch_check::kPython;
using torch_check::Write;
constexpr int kSteps = 20;

struct Tensor {
  std::string name;
  size_t size;  // none a multiple of 16, so torch's scalar loop tails run too
};

// ~100k elements; the largest is over torch's 32768-element grain, so torch
// splits it between threads.
const std::vector<Tensor>& Tensors() {
  static const auto* tensors = new std::vector<Tensor>{
      {"layers.0.attn.qkv.weight", 65537},
      {"layers.0.input_norm.weight", 1031},
      {"lm_head.weight", 33333},
  };
  return *tensors;
}

// Zeros of both signs, subnormals, huge values (whose squares overflow in
// AdamW's exp_avg_sq), and otherwise magnitudes from 2^min_exponent to
// 2^max_exponent, both signs. Built from std::mt19937's raw bits, which the
// standard fixes, so every platform draws the same values.
float RandomValue(std::mt19937& random, int min_exponent, int max_exponent) {
  const uint32_t kind = random() % 64;
  const float sign = random() % 2 ? -1.0f : 1.0f;
  if (kind < 3) return sign * 0.0f;
  const float mantissa = 1.0f + static_cast<float>(random() >> 9) * 0x1p-23f;
  int exponent;
  if (kind < 5) {
    exponent = -149 + static_cast<int>(random() % 23);  // subnormal
  } else if (kind < 6) {
    exponent = 60 + static_cast<int>(random() % 11);  // square overflows
  } else {
    exponent = min_exponent + static_cast<int>(random() % (max_exponent - min_exponent + 1));
  }
  return sign * std::ldexp(mantissa, exponent);
}

void WriteFloats(std::ofstream& out, std::span<const float> values, size_t size) {
  if (values.empty()) {
    Write(out, std::vector<float>(size, 0.0f));
  } else {
    out.write(reinterpret_cast<const char*>(values.data()),
              static_cast<std::streamsize>(values.size() * sizeof(float)));
  }
}

TEST(OptimizerTorchTest, StepsMatchPyTorchBits) {
  if (!torch_check::TorchAvailable()) {
    LAYERCAST_PREREQUISITE_MISSING(
        absl::StrCat(kPython,
                     " cannot import torch (apt install python3-torch): no check against PyTorch's "
                     "optimizers"));
  }
  const std::vector<std::string> specs = {
      "sgd:lr=0.1",
      "sgd:lr=0.05,momentum=0.9,weight_decay=1e-4",
      "sgd:lr=0.1,momentum=0.9,nesterov=1,weight_decay=1e-4",
      "adamw:lr=1e-3",
      "adamw:lr=3e-4,beta1=0.9,beta2=0.95,weight_decay=0.1,warmup_steps=5,decay_steps=10,"
      "min_lr=3e-5",
      "adamw:lr=3e-4,beta2=0.95,weight_decay=0.1;*norm*:weight_decay=0,lr=1e-3,eps=1e-6",
  };
  const std::vector<Tensor>& tensors = Tensors();
  size_t total = 0;
  for (const Tensor& tensor : tensors) total += tensor.size;

  std::mt19937 random(20261130);
  std::vector<float> initial(total);
  for (float& value : initial) value = RandomValue(random, -30, 4);
  std::vector<std::vector<float>> grads(kSteps, std::vector<float>(total));
  for (std::vector<float>& step : grads) {
    for (float& value : step) value = RandomValue(random, -40, 2);
  }

  const std::string path =
      absl::StrCat(::testing::TempDir(), "optimizer_torch_test_", getpid(), ".bin");
  {
    // Layout (little-endian): u64 tensors, steps, configs; u64 size[tensors];
    // f32 initial[total]; f32 grad[steps][total]; per config: u64 spec length,
    // the spec's text, u64 kind (0 sgd, 1 adamw), per tensor f64
    // weight_decay, momentum, nesterov, beta1, beta2, eps; f64 lr[steps][tensors];
    // per step f32 param[total], state1[total] (momentum buffer or exp_avg),
    // state2[total] (exp_avg_sq), zeros where there is no such state. Then
    // u64 clip cases, each f64 total_norm, f64 max_norm, f32 ClipScale.
    std::ofstream out(path, std::ios::binary);
    Write(out, std::vector<uint64_t>{tensors.size(), kSteps, specs.size()});
    for (const Tensor& tensor : tensors) Write(out, std::vector<uint64_t>{tensor.size});
    Write(out, initial);
    for (const std::vector<float>& step : grads) Write(out, step);

    for (const std::string& text : specs) {
      absl::StatusOr<OptimizerSpec> spec = OptimizerSpec::Parse(text);
      ASSERT_TRUE(spec.ok()) << spec.status();
      Write(out, std::vector<uint64_t>{text.size()});
      out.write(text.data(), static_cast<std::streamsize>(text.size()));
      Write(out, std::vector<uint64_t>{spec->kind() == OptimizerKind::kSgd ? 0u : 1u});
      std::vector<TensorOptimizer> optimizers;
      for (const Tensor& tensor : tensors) {
        const OptimizerHyper hyper = spec->HyperFor(tensor.name);
        Write(out,
              std::vector<double>{hyper.weight_decay, hyper.momentum, hyper.nesterov ? 1.0 : 0.0,
                                  hyper.beta1, hyper.beta2, hyper.eps});
        optimizers.emplace_back(spec->kind(), hyper, tensor.size);
      }
      std::vector<double> lrs;
      for (uint64_t step = 1; step <= kSteps; ++step) {
        for (const TensorOptimizer& optimizer : optimizers) {
          lrs.push_back(spec->LearningRate(optimizer.hyper(), step));
        }
      }
      Write(out, lrs);

      std::vector<float> param = initial;
      for (int step = 0; step < kSteps; ++step) {
        std::vector<float> state1, state2;
        size_t offset = 0;
        for (size_t t = 0; t < tensors.size(); ++t) {
          const size_t size = tensors[t].size;
          ASSERT_TRUE(optimizers[t]
                          .Step(lrs[step * tensors.size() + t],
                                std::span<float>(param).subspan(offset, size),
                                std::span<const float>(grads[step]).subspan(offset, size))
                          .ok());
          offset += size;
        }
        Write(out, param);
        for (const TensorOptimizer& optimizer : optimizers) {
          WriteFloats(out,
                      spec->kind() == OptimizerKind::kSgd ? optimizer.momentum_buffer()
                                                          : optimizer.exp_avg(),
                      optimizer.size());
        }
        for (const TensorOptimizer& optimizer : optimizers) {
          WriteFloats(out, optimizer.exp_avg_sq(), optimizer.size());
        }
      }
    }

    std::vector<double> norms = {0,   1e-7, 0.5,  0.999999, 1,   1.0000001, 2.5,    3.7,
                                 1e3, 1e30, 1e39, INFINITY, NAN, 0x1p-140,  123.456};
    for (int i = 0; i < 200; ++i) norms.push_back(std::ldexp(1.0 + random() * 0x1p-32, i / 4 - 25));
    Write(out, std::vector<uint64_t>{norms.size() * 3});
    for (double norm : norms) {
      for (double max_norm : {1.0, 0.3, 5.0}) {
        Write(out, std::vector<double>{norm, max_norm});
        Write(out, std::vector<float>{ClipScale(norm, max_norm)});
      }
    }
    ASSERT_TRUE(out.good()) << path;
  }
  torch_check::RunScript("optimizer_torch_test.py", path);
}

}  // namespace
}  // namespace layercast
