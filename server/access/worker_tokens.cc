#include "server/access/worker_tokens.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "platform/status_macros.h"
#include "server/access/auth_file.h"

namespace layercast::server {

absl::StatusOr<WorkerTokens> WorkerTokens::FromDir(const std::string& dir, uint32_t workers,
                                                   FileSystem& fs) {
  std::vector<AdminToken> tokens;
  std::vector<std::string> texts;
  for (uint32_t k = 0; k < workers; ++k) {
    const std::string path = absl::StrCat(dir, "/worker-", k);
    if (!fs.Exists(path)) {
      return absl::NotFoundError(absl::StrCat("--worker-token-dir ", dir, " has no file worker-", k,
                                              ": it needs one token file per "
                                              "data-parallel worker, worker-0 to worker-",
                                              workers - 1));
    }
    ASSIGN_OR_RETURN(const std::string content,
                     ReadCredentialFile(path, "worker-token-dir", 2 * AdminToken::kMaxLength,
                                        CredentialKind::kSecret, fs));
    const absl::string_view text = absl::StripAsciiWhitespace(content);
    ASSIGN_OR_RETURN(AdminToken token,
                     AdminToken::FromString(text, absl::StrCat("--worker-token-dir ", path)));
    for (uint32_t other = 0; other < tokens.size(); ++other) {
      if (tokens[other].Matches(text)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--worker-token-dir ", dir, ": worker-", other, " and worker-", k,
                         " hold the same token, so neither identifies its worker; give each "
                         "worker its own (e.g. `openssl rand -hex 32`)"));
      }
    }
    tokens.push_back(std::move(token));
  }
  return WorkerTokens(std::move(tokens));
}

absl::Status WorkerTokens::Check(uint32_t worker, const std::string* authorization,
                                 absl::string_view what) const {
  const std::optional<absl::string_view> presented = BearerTokenOf(authorization);
  if (!presented) {
    return absl::UnauthenticatedError(absl::StrCat(
        what, " for worker ", worker,
        " needs that worker's token: this shard was started with --worker-token-dir; send "
        "'authorization: Bearer <token>' with the worker's token (the worker library's "
        "worker_token)"));
  }
  if (worker >= tokens_.size() || !tokens_[worker].Matches(*presented)) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, " for worker ", worker,
                     " carries another token than that worker's (--worker-token-dir's worker-",
                     worker, "): a worker pushes only under its own index"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> WorkerTokens::Identify(const std::string* authorization,
                                                absl::string_view what) const {
  const std::optional<absl::string_view> presented = BearerTokenOf(authorization);
  if (!presented) {
    return absl::UnauthenticatedError(absl::StrCat(
        what,
        " needs a worker's token: this shard was started with --worker-token-dir; send "
        "'authorization: Bearer <token>' with the worker's token in the call's metadata (the "
        "worker library's worker_token). Nothing was staged"));
  }
  std::optional<uint32_t> found;
  for (uint32_t worker = 0; worker < tokens_.size(); ++worker) {
    if (tokens_[worker].Matches(*presented) && !found) found = worker;
  }
  if (!found) {
    return absl::PermissionDeniedError(
        absl::StrCat(what,
                     " carries a token that is no worker's (--worker-token-dir holds worker-0 to "
                     "worker-",
                     tokens_.size() - 1, "): send this worker's own token. Nothing was staged"));
  }
  return *found;
}

}  // namespace layercast::server
