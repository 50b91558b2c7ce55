#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tools/cli_flags.h"

namespace layercast::cli {

// The `layercast` subcommands. Each takes the arguments after its name,
// prints its results to stdout and progress to stderr, and returns a status
// whose message main() prints.

// layercast manifest --shards A,B,...
absl::Status RunManifest(const std::vector<std::string>& args);
// layercast cast-error --shards A,B,...: what the shards' casts lost, by
// layer (client/cast_error_report.h).
absl::Status RunCastError(const std::vector<std::string>& args);
// layercast fetch --shards A,B,... --layer L --out FILE.safetensors
absl::Status RunFetch(const std::vector<std::string>& args);
// layercast export --shards A,B,... --out FILE.safetensors [--dtype D]
//     [--version V]: the whole model at one version (client/model_export.h).
absl::Status RunExport(const std::vector<std::string>& args);
// layercast relay --shards A,B,... --listen H:P,... [--upstream R0,R1,...]:
// a mirror that serves the set's reads to mirrors below it (relay/relay.h)
// until SIGTERM or SIGINT.
absl::Status RunRelay(const std::vector<std::string>& args);
// layercast bench --shards A,B,... [--rounds R]
absl::Status RunBench(const std::vector<std::string>& args);
// layercast checkpoint --shards A,B,... --token-file F [--timeout-seconds S]
//     [--insecure]: refuses to send the token in plaintext unless --insecure.
absl::Status RunCheckpoint(const std::vector<std::string>& args);
absl::Status RunHandOver(const std::vector<std::string>& args);
// layercast demo [--num-shards N] [--synthetic SPEC | --model PATH] ...
absl::Status RunDemo(const std::vector<std::string>& args);
// layercast demo --train ...: the training steps (forward gather, backward
// gather, gradient push) against N local training shards.
absl::Status RunTrainDemo(const tools::CliFlags& flags);
// layercast demo --publish ...: a trainer publishing every step to N local
// read-only shards and M mirrors following it by delta pulls.
absl::Status RunPublishDemo(const tools::CliFlags& flags);

}  // namespace layercast::cli
