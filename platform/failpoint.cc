#include "platform/failpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "platform/log.h"

namespace layercast {
namespace {

#ifdef LAYERCAST_FAILPOINTS
// Whether the armed spec `armed` (NAME or NAME@I, without its :N) names
// this point.
bool Matches(absl::string_view armed, absl::string_view name, std::optional<uint32_t> shard) {
  const std::pair<absl::string_view, absl::string_view> parts = absl::StrSplit(armed, '@');
  if (parts.first != name) return false;
  if (parts.second.empty()) return true;
  uint32_t index = 0;
  return shard && absl::SimpleAtoi(parts.second, &index) && index == *shard;
}

struct Armed {
  std::string spec;
  std::string once_file;
};

Armed& ArmedPoints() {
  static Armed* const armed = new Armed;
  return *armed;
}
#endif

}  // namespace

void ArmFailPoints(const char* spec, const char* once_file) {
#ifdef LAYERCAST_FAILPOINTS
  ArmedPoints() = Armed{spec == nullptr ? "" : spec, once_file == nullptr ? "" : once_file};
#else
  (void)spec;
  (void)once_file;
#endif
}

void FailPoint(absl::string_view name, std::optional<uint32_t> shard) {
#ifdef LAYERCAST_FAILPOINTS
  const Armed& armed = ArmedPoints();
  if (armed.spec.empty()) return;
  const std::pair<absl::string_view, absl::string_view> spec = absl::StrSplit(armed.spec, ':');
  if (!Matches(spec.first, name, shard)) return;
  // NAME:N fires on the N-th time this process reaches the point.
  static std::atomic<uint64_t> reached{0};
  uint64_t nth = 1;
  if (!spec.second.empty() && !absl::SimpleAtoi(spec.second, &nth)) return;
  if (reached.fetch_add(1) + 1 != nth) return;
  if (!armed.once_file.empty()) {
    // O_EXCL: of two processes reaching the point, one dies.
    const int fd = ::open(armed.once_file.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return;
    ::close(fd);
  }
  Log()->warn("failpoint {}: killing this process (SIGKILL)", name);
  Log()->flush();
  ::raise(SIGKILL);
#else
  (void)name;
  (void)shard;
#endif
}

}  // namespace layercast
