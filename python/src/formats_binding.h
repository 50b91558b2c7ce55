#pragma once

#include <pybind11/pybind11.h>

namespace layercast::python {

// The native formats the package reads through, rather than writing them
// again in Python: the 8-bit float decode table (core/fp8) and the
// safetensors reader's checked header (core/safetensors).
void BindFormats(pybind11::module_& module);

}  // namespace layercast::python
