#pragma once

#include <optional>

#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "core/model.h"
#include "python/src/connection.h"

namespace layercast::python {

// The dtype's name, as torch and numpy spell it too ("bfloat16").
std::string DTypeString(DType dtype);

// One tensor of a gathered layer, exported through DLPack: Export() hands a
// consumer (torch.from_dlpack) a tensor that aliases the layer's buffer and
// keeps the layer alive until the consumer's tensor is freed.
class TensorView {
 public:
  // `held` keeps the layer (and what it refers to) alive: a HeldLayer's, or
  // a mirror's, through shared_ptr's aliasing constructor.
  //
  // An 8-bit float tensor is two views: its codes (exported as uint8: DLPack
  // consumers here, torch 1.13 among them, have no fp8) and, with `scales`,
  // its fp32 block scales, shape [blocks].
  //
  // `bits`: the same bytes as unsigned integers of the element's width
  // (uint16 for bfloat16), for consumers without the dtype (numpy).
  TensorView(std::shared_ptr<const client::Layer> held, size_t index, bool scales = false,
             bool bits = false)
      : held_(std::move(held)), index_(index), scales_(scales), bits_(bits) {}

  std::string name() const;
  std::vector<int64_t> shape() const;
  std::string dtype() const;
  uint64_t nbytes() const;
  uintptr_t data_ptr() const;
  // Elements per block scale; 0 for a tensor that has none (and for the
  // view of the scales themselves).
  uint32_t block_size() const { return scales_ ? 0 : view().block_size; }
  // The view of this tensor's block scales; nullopt for a tensor without.
  std::optional<TensorView> scales() const;
  // This view's bytes as unsigned integers of the element's width.
  TensorView Bits() const { return TensorView(held_, index_, scales_, /*bits=*/true); }
  // A "dltensor" capsule: compact, row-major, on the CPU. DLPack has no
  // read-only flag: a consumer may write, and changes only this worker's copy.
  pybind11::capsule Export() const;

 private:
  client::Layer::TensorView view() const { return held_->tensor(index_); }

  std::span<const uint8_t> bytes() const;

  std::shared_ptr<const client::Layer> held_;
  size_t index_;
  bool scales_;
  bool bits_;
};

// A tensor taken from Python through DLPack; its producer's deleter runs
// when this dies. Move-only.
class ImportedTensor {
 public:
  explicit ImportedTensor(DLManagedTensor* managed) : managed_(managed, &Delete) {}
  const uint8_t* data() const {
    return static_cast<const uint8_t*>(managed_->dl_tensor.data) + managed_->dl_tensor.byte_offset;
  }

 private:
  static void Delete(DLManagedTensor* managed) {
    if (managed->deleter != nullptr) managed->deleter(managed);
  }
  std::unique_ptr<DLManagedTensor, void (*)(DLManagedTensor*)> managed_;
};

// Takes `tensor` (anything with __dlpack__: a torch.Tensor), the `role`
// ("values", "gradient") of `spec`, without a copy. It must be on the CPU,
// contiguous, of the tensor's shape and of `dtype`: TypeError or ValueError
// saying which, and how to convert it.
ImportedTensor ImportTensor(const pybind11::handle& tensor, const TensorSpec& spec, DType dtype,
                            absl::string_view role);

// Copies `tensor` (anything with __dlpack__: a torch.Tensor), the gradient
// of `spec`, into `destination`, its place (`placed`) in the layer's
// gradient layout. It must be on the CPU, contiguous, of the tensor's shape
// and of placed's dtype (the compute dtype, float32 for 8-bit floats):
// TypeError or ValueError saying which, and how to convert it.
void ImportGradient(const pybind11::handle& tensor, const TensorSpec& spec,
                    const AssembledTensor& placed, uint8_t* destination);

}  // namespace layercast::python
