#include "python/src/formats_binding.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/fp8.h"
#include "core/safetensors.h"
#include "core/safetensors_dtype.h"
#include "core/safetensors_split.h"
#include "platform/status_macros.h"
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

// Whether `info` lies in memory as one run of bytes, in C order: the bytes
// a safetensors tensor holds.
bool IsCContiguous(const py::buffer_info& info) {
  py::ssize_t stride = info.itemsize;
  for (py::ssize_t dim = info.ndim - 1; dim >= 0; --dim) {
    if (info.shape[dim] != 1 && info.strides[dim] != stride) return false;
    stride *= info.shape[dim];
  }
  return true;
}

// The writing itself, without the GIL: each tensor's bytes checked against
// its declaration before they go out, so one tensor never spills into the
// next.
absl::Status Write(const std::string& path,
                   const std::vector<SafetensorsWriter::TensorHeader>& headers,
                   std::span<const std::span<const uint8_t>> data,
                   const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                   SafetensorsWriter::Create(path, headers, metadata));
  for (size_t i = 0; i < headers.size(); ++i) {
    uint64_t declared = headers[i].dtype.size();
    // Create checked these products fit in 64 bits.
    for (int64_t dim : headers[i].shape) declared *= static_cast<uint64_t>(dim);
    if (data[i].size() != declared) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors writer for '", path, "': tensor '", headers[i].name, "' is declared ",
          headers[i].dtype.name(), " of ", declared, " bytes but ", data[i].size(),
          " bytes were given: pass the tensor's own contiguous bytes"));
    }
    RETURN_IF_ERROR(writer->Append(data[i]));
  }
  return writer->Finish();
}

// Python's (name, dtype tag, shape, bytes) entries as the writer's
// declarations and the bytes they declare.
struct Entries {
  std::vector<SafetensorsWriter::TensorHeader> headers;
  // Held until the writing is done: they pin the tensors' memory.
  std::vector<py::buffer_info> buffers;
  std::vector<std::span<const uint8_t>> data;
};

Entries TakeEntries(const std::string& path, const py::list& tensors) {
  Entries entries;
  for (const py::handle entry : tensors) {
    auto [name, tag, shape, bytes] =
        entry.cast<std::tuple<std::string, std::string, std::vector<int64_t>, py::buffer>>();
    entries.headers.push_back(
        {name, ValueOrRaise(SafetensorsDType::FromName(tag)), std::move(shape)});
    py::buffer_info info = bytes.request();
    if (!IsCContiguous(info)) {
      Raise(absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' for '", path,
                       "': its bytes are not contiguous; pass tensor.contiguous()")));
    }
    entries.data.emplace_back(static_cast<const uint8_t*>(info.ptr),
                              static_cast<size_t>(info.size * info.itemsize));
    entries.buffers.push_back(std::move(info));
  }
  return entries;
}

// Writes `tensors` ((name, dtype tag, shape, bytes) each, in file order) as
// one safetensors file through the shards' own writer (core/safetensors),
// so a file from Python is laid out exactly as one from a shard.
void WriteSafetensors(const std::string& path, const py::list& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const Entries entries = TakeEntries(path, tensors);
  absl::Status written;
  {
    py::gil_scoped_release release;
    written = Write(path, entries.headers, entries.data, metadata);
  }
  if (!written.ok()) Raise(written);
}

// Writes `tensors` as one file, or, over `max_file_bytes`, split with an
// index exactly as ShardSet.export splits a model (core/safetensors_split),
// every file carrying `metadata`. Returns the files written, the index
// last.
std::vector<std::string> WriteSafetensorsSplit(const std::string& path, const py::list& tensors,
                                               const std::map<std::string, std::string>& metadata,
                                               uint64_t max_file_bytes) {
  const Entries entries = TakeEntries(path, tensors);
  const SafetensorsSplit split =
      ValueOrRaise(PlanSafetensorsSplit(entries.headers, max_file_bytes, path));
  std::vector<std::string> files;
  absl::Status written = [&]() -> absl::Status {
    py::gil_scoped_release release;
    // The split keeps the tensors' order, so each file's bytes are the
    // next run of them.
    size_t at = 0;
    for (size_t f = 0; f < split.files.size(); ++f) {
      const std::span<const std::span<const uint8_t>> data(entries.data.data() + at,
                                                           split.files[f].size());
      RETURN_IF_ERROR(Write(split.paths[f], split.files[f], data, metadata));
      files.push_back(split.paths[f]);
      at += split.files[f].size();
    }
    if (split.split()) {
      const std::string index = path + ".index.json";
      RETURN_IF_ERROR(WriteSafetensorsIndex(split, index));
      files.push_back(index);
    }
    return absl::OkStatus();
  }();
  if (!written.ok()) Raise(written);
  return files;
}

}  // namespace

void BindFormats(py::module_& module) {
  module.def("fp8_values", &Fp8Values, py::arg("dtype"),
             "The 256 codes' values of an 8-bit float dtype, in code order.");
  module.def("safetensors_header", &SafetensorsHeader, py::arg("path"),
             "(tensors, metadata) of a safetensors model, one file or an index, checked: each "
             "tensor as (name, dtype tag, shape, file, byte offset, byte count).");
  module.def("write_safetensors", &WriteSafetensors, py::arg("path"), py::arg("tensors"),
             py::arg("metadata"),
             "Writes one safetensors file: `tensors` as (name, dtype tag, shape, bytes) in file "
             "order, the bytes C-contiguous (a buffer such as a numpy array), `metadata` its "
             "__metadata__.");
  module.def("write_safetensors_split", &WriteSafetensorsSplit, py::arg("path"), py::arg("tensors"),
             py::arg("metadata"), py::arg("max_file_bytes"),
             "Writes `tensors` (as write_safetensors takes them) as one file, or over "
             "`max_file_bytes` as files and an index, split as ShardSet.export splits a model; "
             "every file carries `metadata`. Returns the files written, the index last.");
}

}  // namespace layercast::python
