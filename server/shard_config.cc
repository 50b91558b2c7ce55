#include "server/shard_config.h"

#include <google/protobuf/util/json_util.h>

#include <charconv>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "core/cast.h"
#include "platform/byte_size.h"
#include "platform/flag_value.h"
#include "platform/status_macros.h"
#include "server/memory_plan.h"

namespace layercast::server {
namespace {

using google::protobuf::FieldDescriptor;

constexpr uint64_t kDefaultChunkBytes = 1 << 20;
constexpr uint32_t kDefaultMaxReceiveMessageBytes = 64 << 10;
// A training shard receives gradient chunks, which the worker library cuts
// at 1 MiB of data (GradientSinkOptions::chunk_bytes), framing included; a
// shard with an admin token, publish chunks of the same size
// (PublishOptions::chunk_bytes).
constexpr uint32_t kDefaultLargeMaxReceiveMessageBytes = 2 << 20;
constexpr uint32_t kMaxDataParallelWorkers = 4096;
constexpr uint32_t kDefaultPinRetentionMs = 30000;
constexpr uint32_t kMaxPinRetentionMs = 3600 * 1000;
constexpr uint32_t kDefaultChangeRecordingIdleMs = 600 * 1000;
constexpr uint32_t kMaxChangeRecordingIdleMs = 86400 * 1000;
constexpr uint32_t kMinReceiveMessageBytes = 1 << 10;
constexpr uint32_t kMaxReceiveMessageBytes = 64 << 20;
constexpr uint32_t kDefaultMaxConcurrentStreamsPerConnection = 100;
constexpr uint32_t kDefaultMaxStreams = 1024;
constexpr uint32_t kDefaultMaxParkedStreams = 4096;
constexpr uint32_t kDefaultMaxPushStreams = 1024;
constexpr uint32_t kDefaultMaxWaitsPerConnection = 8;
constexpr uint32_t kDefaultPublishIdleMs = 3000;
constexpr uint32_t kDefaultMaxVersionLead = 64;
constexpr uint32_t kDefaultDeltaVersions = 4;
constexpr uint32_t kMaxDeltaVersions = 1024;
constexpr uint32_t kDefaultMaxVersionWaitMs = 5 * 60 * 1000;
constexpr uint32_t kDefaultWriteProgressTimeoutMs = 30 * 1000;
constexpr uint32_t kDefaultKeepaliveTimeMs = 60 * 1000;
constexpr uint32_t kDefaultMaxConnectionIdleMs = 10 * 60 * 1000;
// Below gRPC's default 4 MiB receive limit with room for the framing.
constexpr uint64_t kMaxChunkBytes = 3 << 20;

template <typename T>
absl::StatusOr<T> ParseUnsigned(const std::string& flag, const std::string& value) {
  T parsed = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  if (ec != std::errc() || end != value.data() + value.size() || value.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " takes an unsigned integer, not '", value, "'"));
  }
  return parsed;
}

// Sets one field from its textual value. Reflection keeps the flags and the
// config message in step: a new config field is a new flag.
absl::Status SetField(layercast::v1::ShardConfig& config, const FieldDescriptor& field,
                      const std::string& flag, const std::string& value) {
  const auto* reflection = config.GetReflection();
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      reflection->SetString(&config, &field, value);
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_UINT32: {
      ASSIGN_OR_RETURN(uint32_t parsed, ParseUnsigned<uint32_t>(flag, value));
      reflection->SetUInt32(&config, &field, parsed);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      ASSIGN_OR_RETURN(uint64_t parsed, ParseUnsigned<uint64_t>(flag, value));
      reflection->SetUInt64(&config, &field, parsed);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_BOOL:
      if (value == "true" || value == "1") {
        reflection->SetBool(&config, &field, true);
      } else if (value == "false" || value == "0") {
        reflection->SetBool(&config, &field, false);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag, " takes true or false (or 1 or 0), not '", value, "'"));
      }
      return absl::OkStatus();
    default:
      return absl::InternalError(
          absl::StrCat("config field ", field.name(), " has a type flags cannot set"));
  }
}

absl::Status MergeJsonFile(const std::string& path, layercast::v1::ShardConfig& config) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream text;
  text << in.rdbuf();
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(text.str(), &config, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file ", path, " is not a valid ShardConfig: ", status.ToString()));
  }
  return absl::OkStatus();
}

// HOST:PORT as gRPC and the exposer take it, checked here because gRPC
// takes a port beyond 65535 modulo 65536 and logs its own complaint about
// a missing port before failing.
absl::Status CheckListenAddress(const char* flag, const std::string& address) {
  const size_t colon = address.rfind(':');
  const auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, " '", address, "' ", why,
        ": write HOST:PORT, e.g. 127.0.0.1:7070, 0.0.0.0:7070 (every interface) or [::1]:7070, "
        "with a port in 0-65535 (0: any free port)"));
  };
  if (colon == std::string::npos) return invalid("has no port");
  const std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  if (host.empty()) return invalid("has no host");
  if (host.find(':') != std::string::npos && (host.front() != '[' || host.back() != ']')) {
    return invalid("has an IPv6 host without brackets");
  }
  uint32_t number = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), number);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || number > 65535) {
    return invalid("has no port in 0-65535");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<layercast::v1::ShardConfig> ParseShardFlags(const std::vector<std::string>& args) {
  layercast::v1::ShardConfig config;
  std::vector<std::pair<std::string, std::string>> flags;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!absl::StartsWith(arg, "--") || arg.size() == 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "': flags are --name VALUE; see --help"));
    }
    ASSIGN_OR_RETURN(auto flag, TakeFlag(args, &i));
    flags.push_back(std::move(flag));
  }
  for (const auto& [name, value] : flags) {
    if (name == "config") RETURN_IF_ERROR(MergeJsonFile(value, config));
  }
  for (const auto& [name, value] : flags) {
    if (name == "config") continue;
    const FieldDescriptor* field =
        config.GetDescriptor()->FindFieldByName(absl::StrReplaceAll(name, {{"-", "_"}}));
    if (field == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, "; see --help for the flags"));
    }
    RETURN_IF_ERROR(SetField(config, *field, name, value));
  }
  return config;
}

namespace {

// `text` in lines of at most `width` columns, each indented by `indent`.
std::string Wrap(const std::string& text, size_t indent, size_t width) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent + line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

}  // namespace

std::string ShardFlagsHelp() {
  std::string help =
      "usage: layercast-shard [--config FILE.json] [--FLAG VALUE ...] [--dry-run]\n"
      "Serves 1/N of a model's fp32 master parameters, cast just in time.\n\n"
      "  --dry-run\n" +
      Wrap(
          "Reads only the model's headers, prints what every shard of it needs in memory "
          "under the other flags (and whether --memory-budget holds it), and exits: 2 when "
          "the budget is too small, or when the policy cannot be laid out on --num-shards "
          "shards (an 8-bit float block that two shards would split).",
          6, 80) +
      "  --help, --version\n\n"
      "Flags, each also a field of the JSON config (layercast.v1.ShardConfig; boolean\n"
      "flags take true or false, or 1 or 0):\n";
  const auto* descriptor = layercast::v1::ShardConfig::descriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    absl::StrAppend(&help, "  --", absl::StrReplaceAll(field->name(), {{"_", "-"}}), " (",
                    field->type_name(), ")\n",
                    Wrap(field->options().GetExtension(layercast::v1::help), 6, 80));
  }
  absl::StrAppend(&help,
                  "\ndocs/security.md says more of TLS, admin tokens, limits and checkpoints;\n"
                  "docs/training.md of training.\n");
  return help;
}

absl::StatusOr<ShardSettings> ResolveShardConfig(layercast::v1::ShardConfig config) {
  ShardSettings settings;
  if (config.listen().empty()) config.set_listen("127.0.0.1:7070");
  RETURN_IF_ERROR(CheckListenAddress("listen", config.listen()));
  if (!config.metrics_listen().empty()) {
    RETURN_IF_ERROR(CheckListenAddress("metrics-listen", config.metrics_listen()));
  }
  if (!config.health_listen().empty()) {
    RETURN_IF_ERROR(CheckListenAddress("health-listen", config.health_listen()));
  }
  if (config.num_shards() == 0) {
    return absl::InvalidArgumentError(
        "--num-shards N is required: how many shards the set has (at least 1), with "
        "--shard-index I and --model PATH or --synthetic SPEC; layercast-shard --help lists "
        "every flag");
  }
  if (config.shard_index() >= config.num_shards()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard-index ", config.shard_index(), " is out of range: with --num-shards ",
                     config.num_shards(), " it must be 0-", config.num_shards() - 1));
  }
  if (config.model().empty() == config.synthetic().empty()) {
    return absl::InvalidArgumentError(
        "give exactly one of --model PATH (a .safetensors file or model.safetensors.index.json) "
        "and --synthetic SPEC (e.g. llama:layers=8,hidden=2048)");
  }
  if (!config.synthetic().empty() && !config.model_id().empty()) {
    return absl::InvalidArgumentError(
        "--model-id names a checkpoint; a synthetic model's id is its canonical spec");
  }
  if (config.log_format().empty()) config.set_log_format("text");
  if (config.log_level().empty()) config.set_log_level("info");
  ASSIGN_OR_RETURN(settings.log_format, ParseLogFormat(config.log_format()));
  ASSIGN_OR_RETURN(settings.log_level, ParseLogLevel(config.log_level()));
  if (config.policy().empty()) config.set_policy("params=float32,compute=bfloat16,output=float32");
  ASSIGN_OR_RETURN(settings.policy, Policy::Parse(config.policy()));
  if (settings.policy.params() != DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy '", config.policy(), "' keeps params in ", DTypeName(settings.policy.params()),
        ", but shard servers hold float32 masters: use params=float32"));
  }
  if (config.chunk_bytes() == 0) config.set_chunk_bytes(kDefaultChunkBytes);
  if (config.chunk_bytes() < 4 || config.chunk_bytes() > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--chunk-bytes ", config.chunk_bytes(),
                                                   " is out of range: use 4-", kMaxChunkBytes));
  }
  // Below LeastFp8ChunkBytes an 8-bit float chunk would outgrow what the
  // memory plan counts for a stream.
  const Policy& policy = settings.policy;
  const uint64_t least_fp8_chunk = LeastFp8ChunkBytes(policy.fp8_block());
  if (policy.UsesFloat8() && config.chunk_bytes() < least_fp8_chunk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--chunk-bytes ", config.chunk_bytes(), " cannot hold one block of ", policy.fp8_block(),
        " 8-bit codes and three scales (its block's and one for each end of a chunk off the block "
        "grid) under policy '",
        config.policy(), "': use at least ", least_fp8_chunk));
  }
  // Workers of one data-parallel step fetch a layer within moments of each
  // other; a chunk unused for 5 s is unlikely to be asked for again.
  if (config.shared_chunk_max_idle_ms() == 0) config.set_shared_chunk_max_idle_ms(5000);
  if (config.drain_timeout_seconds() == 0) config.set_drain_timeout_seconds(20);
  if (!config.layer_regex().empty()) settings.grouping.layer_regex = config.layer_regex();
  if (config.has_first_layer_prefix()) {
    settings.grouping.first_prefix = config.first_layer_prefix();
  }
  if (!config.memory_budget().empty()) {
    absl::StatusOr<uint64_t> budget = ParseByteSize(config.memory_budget());
    if (!budget.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--memory-budget: ", budget.status().message()));
    }
    settings.memory_budget_bytes = *budget;
  }
  if (!config.has_checkpoint_on_sigterm()) {
    config.set_checkpoint_on_sigterm(!config.checkpoint_dir().empty());
  } else if (config.checkpoint_on_sigterm() && config.checkpoint_dir().empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint-on-sigterm true needs --checkpoint-dir DIR to write to");
  }
  const bool training = !config.optimizer().empty();
  if (!config.has_push_journal()) {
    config.set_push_journal(training && !config.checkpoint_dir().empty());
  } else if (config.push_journal() && (!training || config.checkpoint_dir().empty())) {
    return absl::InvalidArgumentError(
        "--push-journal true needs --optimizer SPEC and --checkpoint-dir DIR: it keeps a training "
        "shard's pushes beside its checkpoint");
  }
  if (config.checkpoint_every() > 0 && (!training || config.checkpoint_dir().empty())) {
    return absl::InvalidArgumentError(
        "--checkpoint-every needs --optimizer SPEC and --checkpoint-dir DIR: it counts training "
        "steps (a read-only shard is checkpointed by ShardAdmin.Checkpoint and on SIGTERM)");
  }
  if (config.max_receive_message_bytes() == 0) {
    config.set_max_receive_message_bytes(config.optimizer().empty() &&
                                                 config.admin_token_file().empty()
                                             ? kDefaultMaxReceiveMessageBytes
                                             : kDefaultLargeMaxReceiveMessageBytes);
  }
  if (config.max_receive_message_bytes() < kMinReceiveMessageBytes ||
      config.max_receive_message_bytes() > kMaxReceiveMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-receive-message-bytes ", config.max_receive_message_bytes(),
        " is out of range: use ", kMinReceiveMessageBytes, "-", kMaxReceiveMessageBytes));
  }
  if (config.max_concurrent_streams_per_connection() == 0) {
    config.set_max_concurrent_streams_per_connection(kDefaultMaxConcurrentStreamsPerConnection);
  }
  if (config.max_concurrent_streams_per_connection() > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--max-concurrent-streams-per-connection ",
                                                   config.max_concurrent_streams_per_connection(),
                                                   " is out of range: use 1-", INT32_MAX));
  }
  if (config.max_streams() == 0) config.set_max_streams(kDefaultMaxStreams);
  if (config.max_parked_streams() == 0) config.set_max_parked_streams(kDefaultMaxParkedStreams);
  if (config.max_push_streams() == 0) config.set_max_push_streams(kDefaultMaxPushStreams);
  if (config.max_waits_per_connection() == 0) {
    config.set_max_waits_per_connection(kDefaultMaxWaitsPerConnection);
  }
  if (config.max_version_lead() == 0) config.set_max_version_lead(kDefaultMaxVersionLead);
  if (config.publish_idle_ms() == 0) config.set_publish_idle_ms(kDefaultPublishIdleMs);
  if (config.max_version_wait_ms() == 0) config.set_max_version_wait_ms(kDefaultMaxVersionWaitMs);
  if (config.write_progress_timeout_ms() == 0) {
    config.set_write_progress_timeout_ms(kDefaultWriteProgressTimeoutMs);
  }
  if (config.keepalive_time_ms() == 0) config.set_keepalive_time_ms(kDefaultKeepaliveTimeMs);
  if (config.max_connection_idle_ms() == 0) {
    config.set_max_connection_idle_ms(kDefaultMaxConnectionIdleMs);
  }
  for (const auto& [flag, value] :
       {std::pair{"keepalive-time-ms", config.keepalive_time_ms()},
        std::pair{"max-connection-idle-ms", config.max_connection_idle_ms()}}) {
    if (value > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " ", value, " is out of range: use 1-", INT32_MAX));
    }
  }
  if (!config.optimizer().empty()) {
    absl::StatusOr<OptimizerSpec> spec = OptimizerSpec::Parse(config.optimizer());
    if (!spec.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--optimizer: ", spec.status().message()));
    }
    settings.optimizer = *std::move(spec);
    if (config.data_parallel_workers() == 0) config.set_data_parallel_workers(1);
  } else if (config.data_parallel_workers() != 0) {
    return absl::InvalidArgumentError(
        "--data-parallel-workers needs --optimizer SPEC: a shard without an optimizer takes no "
        "gradients");
  } else if (!config.worker_token_dir().empty()) {
    return absl::InvalidArgumentError(
        "--worker-token-dir needs --optimizer SPEC: a shard without an optimizer takes no "
        "gradients, so no worker needs a token");
  }
  if (config.data_parallel_workers() > kMaxDataParallelWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data-parallel-workers ", config.data_parallel_workers(),
                     " is out of range: use 1-", kMaxDataParallelWorkers));
  }
  if (config.cast_isa() == "widest") {
    config.set_cast_isa(std::string(CastIsaName(SupportedCastIsas().back())));
  }
  if (!config.cast_isa().empty()) {
    absl::StatusOr<CastIsa> isa = CastIsaFromName(config.cast_isa());
    if (!isa.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cast-isa: ", isa.status().message(), ", or widest"));
    }
    settings.cast_isa = *isa;
  }
  if (!config.has_delta_versions()) {
    // A shard nobody can change (no optimizer, no admin token to publish
    // with) never has a delta to serve: its bitmaps would be dead weight
    // (4 GiB of a Llama-2-70B set of 8).
    const bool changes = !config.optimizer().empty() || !config.admin_token_file().empty();
    config.set_delta_versions(changes ? kDefaultDeltaVersions : 0);
  }
  if (config.delta_versions() > kMaxDeltaVersions) {
    return absl::InvalidArgumentError(absl::StrCat("--delta-versions ", config.delta_versions(),
                                                   " is out of range: use 0-", kMaxDeltaVersions));
  }
  if (config.pin_retention_ms() > kMaxPinRetentionMs) {
    return absl::InvalidArgumentError(absl::StrCat("--pin-retention-ms ", config.pin_retention_ms(),
                                                   " is out of range: use 0-", kMaxPinRetentionMs,
                                                   " (an hour)"));
  }
  if (config.has_pin_retention_ms() && config.pin_retention_ms() > 0 &&
      config.delta_versions() == 0) {
    return absl::InvalidArgumentError(
        "--pin-retention-ms needs --delta-versions of at least 1: the versions kept for pinned "
        "readers are the change log's snapshots; drop --delta-versions 0 or set "
        "--pin-retention-ms 0");
  }
  if (!config.has_change_recording_idle_ms()) {
    config.set_change_recording_idle_ms(kDefaultChangeRecordingIdleMs);
  }
  if (config.change_recording_idle_ms() > kMaxChangeRecordingIdleMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--change-recording-idle-ms ", config.change_recording_idle_ms(),
        " is out of range: use 0-", kMaxChangeRecordingIdleMs, " (a day; 0 records every step)"));
  }
  if (!config.has_pin_retention_ms()) {
    // Without the change log there is nothing to keep (and the resolved
    // config says so).
    config.set_pin_retention_ms(config.delta_versions() == 0 ? 0 : kDefaultPinRetentionMs);
  }
  settings.config = std::move(config);
  return settings;
}

}  // namespace layercast::server
