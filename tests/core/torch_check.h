#pragma once

// What the tests that compare our bits with PyTorch's share: each writes its
// inputs and results to a file, and a script under tests/core/ run by
// Debian's python3 (python3-torch) recomputes them with torch and compares.

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace layercast::torch_check {

inline constexpr char kPython[] = "/usr/bin/python3";

// Whether kPython can import torch; when not, the tests skip saying so, or
// fail under CI (tests/prerequisite.h).
inline bool TorchAvailable() {
  return std::system(absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1").c_str()) == 0;
}

template <typename T>
void Write(std::ofstream& out, const std::vector<T>& values) {
  out.write(reinterpret_cast<const char*>(values.data()),
            static_cast<std::streamsize>(values.size() * sizeof(T)));
}

// Runs tests/core/`script` on `path`, expects it to exit 0 (printing what
// it printed either way), and removes `path`.
inline void RunScript(const std::string& script, const std::string& path) {
  const std::string command =
      absl::StrCat(kPython, " ", LAYERCAST_SOURCE_DIR, "/tests/core/", script, " ", path, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr) << command;
  std::string output;
  char chunk[4096];
  while (size_t n = fread(chunk, 1, sizeof(chunk), pipe)) output.append(chunk, n);
  const int status = pclose(pipe);
  std::remove(path.c_str());
  EXPECT_EQ(status, 0) << command << "\n" << output;
  std::printf("%s", output.c_str());
}

}  // namespace layercast::torch_check
