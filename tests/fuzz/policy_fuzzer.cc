// Fuzzes Policy::Parse on untrusted policy text (a manifest carries one, so a
// worker parses what a shard sends). Properties: a refusal is
// INVALID_ARGUMENT with a message; an accepted policy survives the round trip
// Parse(ToString()) == policy, its canonical form is a fixed point, and
// ComputeDTypeFor answers for any name.

#include <cstdint>
#include <string>

#include "core/policy.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using layercast::Policy;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<Policy> policy = Policy::Parse(text);
  if (!policy.ok()) {
    FUZZ_CHECK(policy.status().code() == absl::StatusCode::kInvalidArgument,
               "Parse refused with %s", policy.status().ToString().c_str());
    FUZZ_CHECK(!policy.status().message().empty(), "Parse refused without a message");
    return 0;
  }
  const std::string canonical = policy->ToString();
  absl::StatusOr<Policy> again = Policy::Parse(canonical);
  FUZZ_CHECK(again.ok(), "the canonical form '%s' does not parse: %s", canonical.c_str(),
             again.status().ToString().c_str());
  FUZZ_CHECK(*again == *policy, "Parse(ToString()) differs: '%s' became '%s'", canonical.c_str(),
             again->ToString().c_str());
  FUZZ_CHECK(again->ToString() == canonical, "ToString is not a fixed point: '%s' then '%s'",
             canonical.c_str(), again->ToString().c_str());

  // Names a manifest would carry, and the policy's own globs as names.
  for (const char* name : {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                           "lm_head.weight", ""}) {
    (void)policy->ComputeDTypeFor(name);
  }
  for (const Policy::Override& override : policy->overrides()) {
    (void)policy->ComputeDTypeFor(override.glob);
  }
  return 0;
}
