#pragma once

#include <pybind11/pybind11.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace layercast::python {

// layercast.Error: made once, when the module loads.
void SetErrorType(PyObject* type);
PyObject* ErrorType();

// Raises layercast.Error(message, code name) for a status that is not OK:
// how every error of the worker library reaches Python.
[[noreturn]] void Raise(const absl::Status& status);

template <typename T>
T ValueOrRaise(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

}  // namespace layercast::python
