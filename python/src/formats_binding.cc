#include "python/src/formats_binding.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/fp8.h"
#include "core/safetensors.h"
#include "python/src/errors.h"

namespace layercast::python {
namespace {

namespace py = pybind11;

// Every code's value in `dtype` ("float8_e4m3fn" or "float8_e5m2"), code
// order: what a worker multiplies by its block scales.
std::vector<float> Fp8Values(const std::string& dtype) {
  const absl::StatusOr<DType> parsed = DTypeFromName(dtype);
  if (!parsed.ok() || !IsFloat8(*parsed)) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat("'", dtype, "' is not an 8-bit float: float8_e4m3fn or float8_e5m2")));
  }
  std::vector<float> values(256);
  for (int code = 0; code < 256; ++code) {
    values[code] = Fp8ToF32(static_cast<uint8_t>(code), Fp8FormatOf(*parsed));
  }
  return values;
}

// A safetensors model's tensors as the native reader checked them (header
// length, JSON, dtypes, shapes, offsets in range and not overlapping, an
// index and its files agreeing both ways), with where each one's bytes
// are, and the first file's metadata: the package reads the bytes itself,
// into tensors of its own.
py::tuple SafetensorsHeader(const std::string& path) {
  std::unique_ptr<SafetensorsReader> reader = ValueOrRaise(SafetensorsReader::Open(path));
  py::list tensors;
  for (const SafetensorsTensor& tensor : reader->tensors()) {
    tensors.append(py::make_tuple(tensor.name, std::string(DTypeSafetensorsName(tensor.dtype)),
                                  tensor.shape, reader->files()[tensor.file], tensor.data_begin,
                                  tensor.num_elements * DTypeSize(tensor.dtype)));
  }
  for (const SafetensorsSkipped& tensor : reader->skipped()) {
    tensors.append(py::make_tuple(tensor.name, tensor.dtype, tensor.shape,
                                  reader->files()[tensor.file], tensor.data_begin, tensor.bytes));
  }
  return py::make_tuple(tensors, reader->metadata());
}

}  // namespace

void BindFormats(py::module_& module) {
  module.def("fp8_values", &Fp8Values, py::arg("dtype"),
             "The 256 codes' values of an 8-bit float dtype, in code order.");
  module.def("safetensors_header", &SafetensorsHeader, py::arg("path"),
             "(tensors, metadata) of a safetensors model, one file or an index, checked: each "
             "tensor as (name, dtype tag, shape, file, byte offset, byte count).");
}

}  // namespace layercast::python
