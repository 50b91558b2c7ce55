// layercast: the worker-side command-line tool over the client library.

#include <cstdio>
#include <string>
#include <vector>

#include "client/cli/commands.h"
#include "core/heap_tuning.h"

namespace {

constexpr char kUsage[] =
    "usage: layercast COMMAND [FLAGS]\n"
    "  manifest --shards A,B,...                      print the model, policy and layers\n"
    "  fetch --shards A,B,... --layer L --out F       gather layer L into a safetensors file\n"
    "  bench --shards A,B,... [--rounds R] [--budget-layers K]\n"
    "                                                 gather every layer R times, report GB/s\n"
    "  checkpoint --shards A,B,... --token-file F [--timeout-seconds S] [--insecure]\n"
    "                                                 have every shard write its checkpoint;\n"
    "                                                 needs TLS (--tls-ca-file) for the token,\n"
    "                                                 or --insecure to send it in plaintext\n"
    "                                                 (loopback testing only)\n"
    "  demo [--num-shards N] [--synthetic SPEC | --model PATH] [--policy P] [--steps S]\n"
    "       [--budget-layers K]\n"
    "                                                 start N local shards and walk every layer\n"
    "                                                 forward then backward, as a training step\n"
    "--budget-layers K: prefetch into at most K x the largest layer of host memory (default 3).\n"
    "Name shards with --shards host:port,... in shard order, or with\n"
    "--shards-pattern 'layercast-{i}.layercast:7070' --num-shards N (i = 0..N-1).\n"
    "TLS: --tls-ca-file CA.pem verifies the shards; --tls-cert-file and --tls-key-file\n"
    "present a client certificate to shards that require one (mutual TLS).\n"
    "Secrets (--token-file, --tls-key-file) must be their owner's alone (chmod 600).\n";

}  // namespace

int main(int argc, char** argv) {
  layercast::KeepChunkBuffersInHeap();
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  absl::Status status;
  if (command == "manifest") {
    status = layercast::cli::RunManifest(args);
  } else if (command == "fetch") {
    status = layercast::cli::RunFetch(args);
  } else if (command == "bench") {
    status = layercast::cli::RunBench(args);
  } else if (command == "checkpoint") {
    status = layercast::cli::RunCheckpoint(args);
  } else if (command == "demo") {
    status = layercast::cli::RunDemo(args);
  } else {
    std::fprintf(stderr, "layercast: unknown command '%s'\n%s", command.c_str(), kUsage);
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "layercast %s: %s\n", command.c_str(),
                 std::string(status.message()).c_str());
    return absl::IsInvalidArgument(status) ? 2 : 1;
  }
  return 0;
}
