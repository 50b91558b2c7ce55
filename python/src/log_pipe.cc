#include "python/src/log_pipe.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "platform/log.h"

namespace layercast::python {
namespace {

// Within PIPE_BUF (4096 on Linux), so a line is written whole or not at
// all, never interleaved with another.
constexpr size_t kMaxLineBytes = 4000;

}  // namespace

void RouteLogsToPipe(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  RouteLogs(
      [fd](spdlog::level::level_enum level, absl::string_view message) {
        std::string line = std::to_string(static_cast<int>(level)) + " ";
        line.append(message.data(), std::min(message.size(), kMaxLineBytes));
        std::replace(line.begin(), line.end(), '\n', ' ');
        std::replace(line.begin(), line.end(), '\r', ' ');
        line += '\n';
        // EAGAIN: the reader is behind, and the line is dropped.
        [[maybe_unused]] const ssize_t written = ::write(fd, line.data(), line.size());
      },
      spdlog::level::info);
}

}  // namespace layercast::python
