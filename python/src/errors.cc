#include "python/src/errors.h"

#include <string>

namespace layercast::python {
namespace {

PyObject* g_error = nullptr;

}  // namespace

void SetErrorType(PyObject* type) { g_error = type; }
PyObject* ErrorType() { return g_error; }

void Raise(const absl::Status& status) {
  pybind11::object type = pybind11::reinterpret_borrow<pybind11::object>(g_error);
  pybind11::object instance =
      type(std::string(status.message()), std::string(absl::StatusCodeToString(status.code())));
  PyErr_SetObject(g_error, instance.ptr());
  throw pybind11::error_already_set();
}

}  // namespace layercast::python
