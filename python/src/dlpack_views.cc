#include "python/src/dlpack_views.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace layercast::python {
namespace {

namespace py = pybind11;

DLDataType ToDLDataType(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return {kDLBfloat, 16, 1};
    case DType::kFloat16:
      return {kDLFloat, 16, 1};
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
      return {kDLUInt, 8, 1};
    default:
      return {kDLFloat, 32, 1};
  }
}

}  // namespace

std::string DTypeString(DType dtype) { return std::string(DTypeName(dtype)); }

std::string TensorView::name() const { return std::string(view().name); }

std::vector<int64_t> TensorView::shape() const {
  if (scales_) return {static_cast<int64_t>(view().scales.size())};
  const auto shape = view().shape;
  return {shape.begin(), shape.end()};
}

std::string TensorView::dtype() const {
  const DType dtype = scales_ ? DType::kFloat32 : view().dtype;
  return bits_ ? absl::StrCat("uint", 8 * DTypeSize(dtype)) : DTypeString(dtype);
}

std::span<const uint8_t> TensorView::bytes() const {
  if (!scales_) return view().bytes;
  const std::span<const float> scales = view().scales;
  return {reinterpret_cast<const uint8_t*>(scales.data()), scales.size_bytes()};
}

uint64_t TensorView::nbytes() const { return bytes().size(); }

uintptr_t TensorView::data_ptr() const { return reinterpret_cast<uintptr_t>(bytes().data()); }

std::optional<TensorView> TensorView::scales() const {
  if (scales_ || view().block_size == 0) return std::nullopt;
  return TensorView(held_, index_, /*scales=*/true);
}

py::capsule TensorView::Export() const {
  struct Context {
    std::shared_ptr<const client::Layer> held;
    std::vector<int64_t> shape;
    DLManagedTensor managed;
  };
  auto context = std::make_unique<Context>();
  context->held = held_;
  context->shape = shape();
  DLTensor& dl = context->managed.dl_tensor;
  dl.data = const_cast<uint8_t*>(bytes().data());
  dl.device = {kDLCPU, 0};
  dl.ndim = static_cast<int32_t>(context->shape.size());
  const DType dtype = scales_ ? DType::kFloat32 : view().dtype;
  dl.dtype = bits_ ? DLDataType{kDLUInt, static_cast<uint8_t>(8 * DTypeSize(dtype)), 1}
                   : ToDLDataType(dtype);
  dl.shape = context->shape.data();
  dl.strides = nullptr;  // compact, row-major
  dl.byte_offset = 0;
  context->managed.manager_ctx = context.get();
  context->managed.deleter = [](DLManagedTensor* self) {
    delete static_cast<Context*>(self->manager_ctx);
  };
  DLManagedTensor* managed = &context.release()->managed;
  // A capsule never consumed (still named "dltensor") frees its tensor; a
  // consumer renames it and calls the deleter when its tensor dies.
  return py::capsule(managed, "dltensor", [](PyObject* capsule) {
    if (PyCapsule_IsValid(capsule, "dltensor")) {
      auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
      tensor->deleter(tensor);
    }
  });
}

ImportedTensor ImportTensor(const py::handle& tensor, const TensorSpec& spec, DType dtype,
                            absl::string_view role) {
  if (!py::hasattr(tensor, "__dlpack__")) {
    throw py::type_error(absl::StrCat("the ", role, " of ", spec.name,
                                      " is not a tensor: pass a torch.Tensor (or any object with "
                                      "__dlpack__)"));
  }
  py::capsule capsule = tensor.attr("__dlpack__")();
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  // Consumed: the deleter is the ImportedTensor's to call, on every path.
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  ImportedTensor imported(managed);
  const DLTensor& dl = managed->dl_tensor;
  const DLDataType want = ToDLDataType(dtype);
  if (dl.device.device_type != kDLCPU) {
    throw py::value_error(absl::StrCat("the ", role, " of ", spec.name,
                                       " is not in host memory: move it with .cpu()"));
  }
  if (dl.dtype.code != want.code || dl.dtype.bits != want.bits || dl.dtype.lanes != 1) {
    throw py::type_error(absl::StrCat("the ", role, " of ", spec.name, " must be ",
                                      DTypeString(dtype), ": convert it with .to()"));
  }
  const std::vector<int64_t> shape(dl.shape, dl.shape + dl.ndim);
  if (shape != spec.shape) {
    throw py::value_error(absl::StrCat("the ", role, " of ", spec.name, " has shape [",
                                       absl::StrJoin(shape, ", "), "], the tensor [",
                                       absl::StrJoin(spec.shape, ", "), "]"));
  }
  if (dl.strides != nullptr) {
    int64_t expected = 1;
    for (int32_t d = dl.ndim; d-- > 0;) {
      if (dl.shape[d] != 1 && dl.strides[d] != expected) {
        throw py::value_error(absl::StrCat("the ", role, " of ", spec.name,
                                           " is not contiguous: pass .contiguous()"));
      }
      expected *= dl.shape[d];
    }
  }
  return imported;
}

void ImportGradient(const py::handle& tensor, const TensorSpec& spec, const AssembledTensor& placed,
                    uint8_t* destination) {
  const ImportedTensor gradient = ImportTensor(tensor, spec, placed.compute_dtype, "gradient");
  std::memcpy(destination, gradient.data(), placed.num_elements * DTypeSize(placed.compute_dtype));
}

}  // namespace layercast::python
