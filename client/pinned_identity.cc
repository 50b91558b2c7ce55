#include "client/pinned_identity.h"

#include "absl/strings/str_cat.h"
#include "wire/incarnation.h"

namespace layercast::client {

absl::Status PinnedIdentity::Check(uint32_t shard, uint64_t incarnation, uint64_t version,
                                   absl::string_view describe) {
  absl::MutexLock lock(&mu_);
  if (incarnations_.size() <= shard) incarnations_.resize(shard + 1, 0);
  uint64_t& recorded = incarnations_[shard];
  if (recorded == 0 || recorded == incarnation) {
    recorded = incarnation;
    return absl::OkStatus();
  }
  return absl::AbortedError(absl::StrCat(
      describe, " serves version ", version, " as incarnation ", wire::IncarnationName(incarnation),
      ", but this walk read version ", version, " from its incarnation ",
      wire::IncarnationName(recorded),
      ": the shard restarted, and the same number may name other values now; walk again "
      "from the first layer"));
}

std::vector<uint64_t> PinnedIdentity::incarnations() const {
  absl::MutexLock lock(&mu_);
  return incarnations_;
}

}  // namespace layercast::client
