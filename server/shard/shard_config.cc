#include "server/shard/shard_config.h"

#include <google/protobuf/util/json_util.h>

#include <cerrno>
#include <charconv>
#include <cstring>
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
#include "server/shard/memory_plan.h"
#include "wire/gradient_chunks.h"

namespace layercast::server {
namespace {

using google::protobuf::FieldDescriptor;

// A training shard receives gradient chunks, a shard with an admin token
// publish chunks, which the worker library cuts at kWriteChunkBytes of data:
// room for one and its framing. The other defaults are config.proto's.
constexpr uint32_t kLargeMaxReceiveMessageBytes = 2 * wire::kWriteChunkBytes;

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
  errno = 0;
  std::ifstream in(path);
  if (!in) {
    // The reason (no such file, permission denied) is the fix's first clue.
    const std::string reason = errno != 0 ? std::strerror(errno) : "cannot open it";
    return absl::NotFoundError(absl::StrCat("cannot read config file ", path, ": ", reason));
  }
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

std::string FlagName(const FieldDescriptor& field) {
  return absl::StrReplaceAll(field.name(), {{"_", "-"}});
}

// Applies every default and range config.proto writes (its default_value,
// min_value, max_value and default_text options), so each is written once.
absl::Status ApplyDefaultsAndRanges(layercast::v1::ShardConfig& config) {
  const google::protobuf::Reflection& reflection = *config.GetReflection();
  const google::protobuf::Descriptor& descriptor = *config.GetDescriptor();
  for (int i = 0; i < descriptor.field_count(); ++i) {
    const FieldDescriptor& field = *descriptor.field(i);
    const google::protobuf::FieldOptions& options = field.options();
    if (field.cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
      if (options.HasExtension(layercast::v1::default_text) &&
          reflection.GetString(config, &field).empty()) {
        reflection.SetString(&config, &field, options.GetExtension(layercast::v1::default_text));
      }
      continue;
    }
    const bool wide = field.cpp_type() == FieldDescriptor::CPPTYPE_UINT64;
    if (!wide && field.cpp_type() != FieldDescriptor::CPPTYPE_UINT32) continue;
    const auto get = [&] {
      return wide ? reflection.GetUInt64(config, &field) : reflection.GetUInt32(config, &field);
    };
    const bool unset = field.has_presence() ? !reflection.HasField(config, &field) : get() == 0;
    if (unset && options.HasExtension(layercast::v1::default_value)) {
      const uint64_t value = options.GetExtension(layercast::v1::default_value);
      if (wide) {
        reflection.SetUInt64(&config, &field, value);
      } else {
        reflection.SetUInt32(&config, &field, static_cast<uint32_t>(value));
      }
    }
    const uint64_t least = options.GetExtension(layercast::v1::min_value);
    const uint64_t most = options.HasExtension(layercast::v1::max_value)
                              ? options.GetExtension(layercast::v1::max_value)
                              : (wide ? UINT64_MAX : UINT32_MAX);
    if (const uint64_t value = get(); value < least || value > most) {
      return absl::InvalidArgumentError(absl::StrCat("--", FlagName(field), " ", value,
                                                     " is out of range: use ", least, "-", most));
    }
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
    const google::protobuf::FieldOptions& options = field->options();
    const std::string text = absl::StrReplaceAll(
        options.GetExtension(layercast::v1::help),
        {{"{default}", options.HasExtension(layercast::v1::default_text)
                           ? options.GetExtension(layercast::v1::default_text)
                           : absl::StrCat(options.GetExtension(layercast::v1::default_value))},
         {"{min}", absl::StrCat(options.GetExtension(layercast::v1::min_value))},
         {"{max}", absl::StrCat(options.GetExtension(layercast::v1::max_value))}});
    absl::StrAppend(&help, "  --", FlagName(*field), " (", field->type_name(), ")\n",
                    Wrap(text, 6, 80));
  }
  absl::StrAppend(&help,
                  "\ndocs/security.md says more of TLS, admin tokens, limits and checkpoints;\n"
                  "docs/training.md of training.\n");
  return help;
}

absl::StatusOr<ShardSettings> ResolveShardConfig(layercast::v1::ShardConfig config) {
  ShardSettings settings;
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
  const bool training = !config.optimizer().empty();
  // A shard nobody can change (no optimizer, no admin token to publish with).
  const bool changes = training || !config.admin_token_file().empty();
  if (!training && config.data_parallel_workers() != 0) {
    return absl::InvalidArgumentError(
        "--data-parallel-workers needs --optimizer SPEC: a shard without an optimizer takes no "
        "gradients");
  }
  if (!training && !config.optimizer_state().empty()) {
    return absl::InvalidArgumentError(
        "--optimizer-state needs --optimizer SPEC: the state is the optimizer's, and a shard "
        "without one does not train");
  }
  if (!config.hand_over_from().empty() &&
      (!training || config.admin_token_file().empty() || !config.optimizer_state().empty())) {
    return absl::InvalidArgumentError(
        "--hand-over-from needs --optimizer SPEC and --admin-token-file (the old set's token, "
        "with which this shard reads its state), and no --optimizer-state: the state comes from "
        "the old set");
  }
  if (training && config.cast_cache_bytes() > 0) {
    return absl::InvalidArgumentError(
        "--cast-cache-bytes serves a read-only shard: a training shard's layers change every "
        "step, so nothing it kept would be read again; drop --cast-cache-bytes or --optimizer");
  }
  if (!training && !config.worker_token_dir().empty()) {
    return absl::InvalidArgumentError(
        "--worker-token-dir needs --optimizer SPEC: a shard without an optimizer takes no "
        "gradients, so no worker needs a token");
  }
  // The defaults that depend on other fields, before config.proto's own.
  if (config.max_receive_message_bytes() == 0 && changes) {
    config.set_max_receive_message_bytes(kLargeMaxReceiveMessageBytes);
  }
  // Such a shard never has a delta to serve: its bitmaps would be dead
  // weight (4 GiB of a Llama-2-70B set of 8), and without them there is
  // nothing to keep for pinned readers (the resolved config says so).
  if (!config.has_delta_versions() && !changes) config.set_delta_versions(0);
  if (!config.has_pin_retention_ms() && config.has_delta_versions() &&
      config.delta_versions() == 0) {
    config.set_pin_retention_ms(0);
  }
  if (!config.has_checkpoint_on_sigterm()) {
    config.set_checkpoint_on_sigterm(!config.checkpoint_dir().empty());
  } else if (config.checkpoint_on_sigterm() && config.checkpoint_dir().empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint-on-sigterm true needs --checkpoint-dir DIR to write to");
  }
  if (!config.has_push_journal()) {
    config.set_push_journal(training && !config.checkpoint_dir().empty());
  } else if (config.push_journal() && (!training || config.checkpoint_dir().empty())) {
    return absl::InvalidArgumentError(
        "--push-journal true needs --optimizer SPEC and --checkpoint-dir DIR: it keeps a training "
        "shard's pushes beside its checkpoint");
  }
  if (config.accept_journal_damage() && !config.push_journal()) {
    return absl::InvalidArgumentError(
        "--accept-journal-damage true needs a push journal to accept damage in: --optimizer SPEC "
        "and --checkpoint-dir DIR, with --push-journal left true");
  }
  if ((!config.journal_sync().empty() || config.has_journal_sync_interval_ms()) &&
      !config.push_journal()) {
    return absl::InvalidArgumentError(
        "--journal-sync and --journal-sync-interval-ms need a push journal to sync: --optimizer "
        "SPEC and --checkpoint-dir DIR, with --push-journal left true");
  }
  if (config.checkpoint_every() > 0 && (!training || config.checkpoint_dir().empty())) {
    return absl::InvalidArgumentError(
        "--checkpoint-every needs --optimizer SPEC and --checkpoint-dir DIR: it counts training "
        "steps (a read-only shard is checkpointed by ShardAdmin.Checkpoint and on SIGTERM)");
  }
  const bool interval_set = config.has_journal_sync_interval_ms();
  RETURN_IF_ERROR(ApplyDefaultsAndRanges(config));
  if (absl::StatusOr<PushJournal::Sync> sync = PushJournal::ParseSync(config.journal_sync());
      !sync.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--journal-sync: ", sync.status().message()));
  } else {
    settings.journal_sync = *sync;
  }
  if (interval_set && settings.journal_sync != PushJournal::Sync::kGrouped) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--journal-sync-interval-ms ", config.journal_sync_interval_ms(),
        " spaces the syncs of --journal-sync grouped, and --journal-sync is '",
        config.journal_sync(), "': pass --journal-sync grouped, or drop the interval"));
  }
  // A read-only shard has no workers (its manifest says 0).
  if (!training) config.set_data_parallel_workers(0);
  if (config.pin_retention_ms() > 0 && config.delta_versions() == 0) {
    return absl::InvalidArgumentError(
        "--pin-retention-ms needs --delta-versions of at least 1: the versions kept for pinned "
        "readers are the change log's snapshots; drop --delta-versions 0 or set "
        "--pin-retention-ms 0");
  }

  RETURN_IF_ERROR(CheckListenAddress("listen", config.listen()));
  if (!config.metrics_listen().empty()) {
    RETURN_IF_ERROR(CheckListenAddress("metrics-listen", config.metrics_listen()));
  }
  if (!config.health_listen().empty()) {
    RETURN_IF_ERROR(CheckListenAddress("health-listen", config.health_listen()));
  }
  ASSIGN_OR_RETURN(settings.log_format, ParseLogFormat(config.log_format()));
  ASSIGN_OR_RETURN(settings.log_level, ParseLogLevel(config.log_level()));
  ASSIGN_OR_RETURN(settings.policy, Policy::Parse(config.policy()));
  if (settings.policy.params() != DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy '", config.policy(), "' keeps params in ", DTypeName(settings.policy.params()),
        ", but shard servers hold float32 masters: use params=float32"));
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
  if (training) {
    absl::StatusOr<OptimizerSpec> spec = OptimizerSpec::Parse(config.optimizer());
    if (!spec.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--optimizer: ", spec.status().message()));
    }
    settings.optimizer = *std::move(spec);
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
  settings.config = std::move(config);
  return settings;
}

}  // namespace layercast::server
