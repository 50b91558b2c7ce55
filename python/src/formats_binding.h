#pragma once

#include <pybind11/pybind11.h>

namespace layercast::python {

// The native formats the package reads and writes through, rather than
// writing them again in Python: the 8-bit float decode table (core/fp8), the
// safetensors reader's checked header, the safetensors writer
// (core/safetensors) and the split of a large model into files and an
// index (core/safetensors_split).
void BindFormats(pybind11::module_& module);

}  // namespace layercast::python
