// layercast: the worker-side command-line tool over the client library.

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "client/client_defaults.h"
#include "core/build_info.h"
#include "platform/log.h"
#include "programs/layercast/commands.h"
#include "programs/process_start.h"

namespace {

// Flags every command that reaches a shard set takes (programs/layercast/connect.h).
constexpr char kShardSetUsage[] =
    "Shards:\n"
    "  --shards A,B,...            host:port of every shard, in shard order\n"
    "  --shards-pattern P --num-shards N\n"
    "                              or a pattern, e.g. 'layercast-{i}.layercast:7070', i = 0..N-1\n"
    "  --connect-timeout-ms MS     how long to wait for every shard to answer (default "
    "{connect_ms})\n"
    "  --tls-ca-file CA.pem        verify the shards' TLS certificates against this CA\n"
    "  --tls-cert-file F --tls-key-file F\n"
    "                              present a client certificate (mutual TLS); the key must be\n"
    "                              its owner's alone (chmod 600)\n";

struct Command {
  const char* name;
  absl::Status (*run)(const std::vector<std::string>&);
  const char* summary;
  const char* usage;  // flags, each with its type and default (WithDefaults)
  bool reaches_shards;
};

const Command kCommands[] = {
    {"manifest", layercast::cli::RunManifest, "print the model, policy and layers of a shard set",
     "layercast manifest SHARDS\n", true},
    {"cast-error", layercast::cli::RunCastError,
     "print what the shards' casts lost, by layer (relative error, flushed, overflowed)",
     "layercast cast-error SHARDS\n", true},
    {"export", layercast::cli::RunExport,
     "write the whole model at one version as a safetensors model (Hugging Face layout)",
     "layercast export SHARDS --out FILE.safetensors [--dtype D] [--version V]\n"
     "  --out FILE                  where to write; a model over --max-file-size is split\n"
     "                              into FILE's stem-0000i-of-0000N.safetensors beside it\n"
     "                              and FILE.index.json\n"
     "  --dtype D                   float32 (the master, default), bfloat16 or float16\n"
     "  --version V                 the version to export (default: the shards' current)\n"
     "  --max-file-size BYTES       largest data file, e.g. 2GiB (default 5000000000)\n"
     "  --timeout-ms MS             each layer's gather deadline (default {layer_ms})\n"
     "The optimizer's state is not exported here: layercast.torch.export_checkpoint\n"
     "writes it, with the master, for torch.optim from the training shards' checkpoint\n"
     "(docs/training.md, \"In and out of PyTorch\").\n",
     true},
    {"relay", layercast::cli::RunRelay,
     "follow the shards and serve their reads to mirrors (a fleet feeds itself)",
     "layercast relay SHARDS --listen H:P,... [--upstream R0,R1,...] [--keep-versions K]\n"
     "  --listen H:P,...            where to serve each shard of the set, in shard order\n"
     "                              (port 0: any free one; see --port-file)\n"
     "  --upstream R0,R1,...        follow this relay instead of the shards; when it dies,\n"
     "                              follow the shards (SHARDS) and say so\n"
     "  --fallback R0,R1,...        follow this relay instead of the shards when the\n"
     "                              upstream dies\n"
     "  --keep-versions K           superseded versions of each layer kept for deltas and\n"
     "                              pinned reads (default 2, 1-64)\n"
     "  --dtype D                   hold and serve every tensor in D (e.g. float8_e4m3fn)\n"
     "  --layer-timeout-ms MS       each layer's pull; past it the upstream counts as dead\n"
     "                              (default 10000)\n"
     "  --max-version-wait-ms MS    how long a read of a version not here yet waits\n"
     "                              (default 10000)\n"
     "  --max-streams N, --max-parked-streams N, --max-waits-per-connection N,\n"
     "  --max-version-lead N, --write-progress-timeout-ms MS, --memory-budget BYTES\n"
     "                              the shard's limits, with its defaults (layercast-shard\n"
     "                              --help); the budget counts held versions and streams\n"
     "  --metrics-listen H:P        serve Prometheus metrics there\n"
     "  --port-file F               write the served addresses, comma-separated, to F\n"
     "  --serve-tls-cert-file F --serve-tls-key-file F [--serve-tls-client-ca-file F]\n"
     "                              serve TLS (mutual with the CA), as a shard's --tls-*;\n"
     "                              required when the shards are reached over TLS\n"
     "  --serve-plaintext           serve plaintext even so\n"
     "  --serve-without-client-certificates\n"
     "                              serve readers without a certificate even though the\n"
     "                              shards are read with one (--tls-cert-file); without it\n"
     "                              such a relay needs --serve-tls-client-ca-file\n",
     true},
    {"fetch", layercast::cli::RunFetch, "gather one layer into a safetensors file",
     "layercast fetch SHARDS --layer L --out FILE.safetensors [--timeout-ms MS]\n"
     "  --layer L                   the layer's index or its name (e.g. model.layers.3)\n"
     "  --out FILE                  where to write the layer (safetensors)\n"
     "  --timeout-ms MS             the gather's deadline, retries of restarting shards\n"
     "                              included (default {layer_ms})\n"
     "  --verify-shards H:P,...     check the layer (read from a relay) against these\n"
     "                              shards' digests of it; exit non-zero if it differs\n",
     true},
    {"bench", layercast::cli::RunBench, "gather every layer R times and report GB/s",
     "layercast bench SHARDS [--rounds R] [--budget-layers K]\n"
     "  --rounds R                  walks over every layer (default 3)\n"
     "  --budget-layers K           prefetch into at most K x the largest layer of host memory\n"
     "                              (default 3)\n",
     true},
    {"checkpoint", layercast::cli::RunCheckpoint, "have every shard write its checkpoint",
     "layercast checkpoint SHARDS --token-file F [--timeout-seconds S] [--insecure]\n"
     "  --token-file F              the admin token (chmod 600)\n"
     "  --timeout-seconds S         how long the shards may take to write (default 3600)\n"
     "  --insecure                  send the token without TLS (loopback testing only);\n"
     "                              otherwise --tls-ca-file is required\n",
     true},
    {"hand-over", layercast::cli::RunHandOver,
     "freeze a training set at a step boundary, for a set of another size to fill itself from",
     "layercast hand-over SHARDS --token-file F --at-version V [--wait-seconds S] [--insecure]\n"
     "layercast hand-over SHARDS --token-file F --unfreeze [--insecure]\n"
     "  --at-version V              the version the workers step to next: pushes for that\n"
     "                              step are refused, naming the move; waits until every\n"
     "                              shard has finished the steps before it\n"
     "  --wait-seconds S            how long to wait for that (default 600)\n"
     "  --unfreeze                  abandon a hand-over: the set trains on\n"
     "  --token-file F              the admin token (chmod 600)\n"
     "  --insecure                  send the token without TLS (loopback testing only)\n"
     "Then start the new set with --hand-over-from and move the workers to it\n"
     "(docs/deploy.md, Operations: \"Changing the shard count live\").\n",
     true},
    {"demo", layercast::cli::RunDemo,
     "start N local shards and walk every layer forward then backward",
     "layercast demo [--num-shards N] [--synthetic SPEC | --model PATH] [--policy P]\n"
     "               [--steps S] [--budget-layers K] [--shard-binary PATH]\n"
     "               [--train [--optimizer SPEC]] [--publish [--mirrors M] [--lr LR]]\n"
     "  --num-shards N              shard processes on 127.0.0.1 (default 2)\n"
     "  --synthetic SPEC            a built-in model (default a 1.6 GiB llama-like model)\n"
     "  --model PATH                a safetensors file or model.safetensors.index.json\n"
     "  --policy P                  the precision policy (default bf16 compute, norms in f32)\n"
     "  --steps S                   training steps to walk (default 1; 5 with --train)\n"
     "  --budget-layers K           prefetch into at most K x the largest layer (default 3)\n"
     "  --shard-binary PATH         layercast-shard (default: the one beside this program)\n"
     "  --train                     train: each step gathers forward and backward and pushes\n"
     "                              a synthetic gradient per layer; the shards run the optimizer\n"
     "                              (default model: a 4-layer llama-like one)\n"
     "  --optimizer SPEC            with --train (default adamw, lr 1e-4, 2 warm-up steps,\n"
     "                              gradients clipped to norm 1)\n"
     "  --publish                   a trainer keeping its own AdamW publishes every step to\n"
     "                              read-only shards; M mirrors follow by delta pulls and\n"
     "                              report their lag (default 10 steps, a 4-layer model)\n"
     "  --mirrors M                 with --publish: mirrors following (default 4)\n"
     "  --lr LR                     with --publish: the trainer's learning rate (default 1e-4)\n",
     false},
};

// `usage` with the worker library's defaults (client/client_defaults.h) in
// place of {connect_ms} and {layer_ms}, so that the help says what the
// flags fall back to.
std::string WithDefaults(const char* usage) {
  return absl::StrReplaceAll(
      usage, {{"{connect_ms}", absl::StrCat(layercast::client::kConnectTimeout.count())},
              {"{layer_ms}", absl::StrCat(layercast::client::kLayerTimeout.count())}});
}

void PrintUsage(FILE* out) {
  std::fputs("usage: layercast COMMAND [FLAGS]\n\nCommands:\n", out);
  for (const Command& command : kCommands) {
    std::fprintf(out, "  %-12s %s\n", command.name, command.summary);
  }
  std::fputs(
      "  help [COMMAND]  this text, or a command's flags and defaults\n\n"
      "layercast COMMAND --help shows a command's flags; layercast --version the build.\n\n",
      out);
  std::fputs(WithDefaults(kShardSetUsage).c_str(), out);
}

void PrintCommandUsage(const Command& command, FILE* out) {
  std::fprintf(out, "%s: %s\n\nusage: %s", command.name, command.summary,
               WithDefaults(command.usage).c_str());
  if (command.reaches_shards) std::fprintf(out, "\n%s", WithDefaults(kShardSetUsage).c_str());
}

const Command* Find(const std::string& name) {
  for (const Command& command : kCommands) {
    if (name == command.name) return &command;
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  // The worker library's messages (connections, retries): warnings and
  // worse, so they do not crowd the command's own output.
  layercast::StartProcess("layercast", spdlog::level::warn);
  const std::vector<std::string> words(argv + 1, argv + argc);
  if (words.empty()) {
    PrintUsage(stderr);
    return 2;
  }
  const std::string& first = words[0];
  if (first == "--help" || first == "-h") {
    PrintUsage(stdout);
    return 0;
  }
  if (first == "--version") {
    std::puts(layercast::VersionLine("layercast").c_str());
    return 0;
  }
  if (first == "help") {
    if (words.size() == 1) {
      PrintUsage(stdout);
      return 0;
    }
    if (const Command* command = Find(words[1])) {
      PrintCommandUsage(*command, stdout);
      return 0;
    }
    std::fprintf(stderr, "layercast help: unknown command '%s'\n\n", words[1].c_str());
    PrintUsage(stderr);
    return 2;
  }
  const Command* command = Find(first);
  if (command == nullptr) {
    std::fprintf(stderr, "layercast: unknown command '%s'\n\n", first.c_str());
    PrintUsage(stderr);
    return 2;
  }
  const std::vector<std::string> args(words.begin() + 1, words.end());
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      PrintCommandUsage(*command, stdout);
      return 0;
    }
  }
  const absl::Status status = command->run(args);
  if (!status.ok()) {
    std::fprintf(stderr, "layercast %s: %s\n", command->name,
                 std::string(status.message()).c_str());
    if (absl::IsInvalidArgument(status)) {
      std::fprintf(stderr, "(layercast %s --help lists its flags)\n", command->name);
      return 2;
    }
    return 1;
  }
  return 0;
}
