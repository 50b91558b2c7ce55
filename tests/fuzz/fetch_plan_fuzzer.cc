// Fuzzes the server's request validation: PlanFetch with a FetchLayerRequest
// parsed from the input, against every shard of a few small shard sets (a
// synthetic Llama, and a model with awkward tensors: a layer with none,
// scalars, empty tensors, tensors smaller than the shard count), under mixed
// policies. Properties: every shard answers the same code; refusals are
// NOT_FOUND (exactly when the layer does not exist), INVALID_ARGUMENT or
// FAILED_PRECONDITION, with a message (and OUT_OF_RANGE for a delta whose
// base another start of the shard served); an accepted plan's runs are non-empty,
// in tensor order, inside the layer and inside the shard's owned range, and
// its byte count is theirs; and the plans of all shards together cover
// exactly the elements the requested byte range selects, each once.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/synthetic_model.h"
#include "server/serving/fetch_plan.h"
#include "server/serving/parameter_store.h"
#include "tests/fuzz/fuzz_check.h"

namespace layercast::fuzz {
namespace {

// A model whose every element is 0.5: only its shapes matter here.
class AwkwardModel final : public ParameterSource {
 public:
  AwkwardModel() {
    model_.model_id = "awkward";
    model_.layers.push_back(LayerSpec{"empty", {}});
    model_.layers.push_back(LayerSpec{
        "odd",
        {TensorSpec{"scalar", {}, 1}, TensorSpec{"zero", {0}, 0}, TensorSpec{"tiny", {2}, 2},
         TensorSpec{"odd", {7, 3}, 21}, TensorSpec{"zero_rows", {0, 5}, 0}}});
    model_.layers.push_back(
        LayerSpec{"big", {TensorSpec{"big.norm", {1000}, 1000}, TensorSpec{"big", {333}, 333}}});
  }
  const ModelSpec& model() const override { return model_; }
  absl::Status Read(uint32_t, uint32_t, ElementRange, std::span<float> dst) const override {
    std::fill(dst.begin(), dst.end(), 0.5f);
    return absl::OkStatus();
  }

 private:
  ModelSpec model_;
};

// Every shard of one shard set.
struct ShardSet {
  std::string name;
  std::vector<std::unique_ptr<server::ParameterStore>> shards;
};

ShardSet Load(std::string name, const ParameterSource& source, const char* policy_text,
              uint32_t num_shards) {
  ShardSet set{std::move(name), {}};
  const absl::StatusOr<Policy> policy = Policy::Parse(policy_text);
  FUZZ_CHECK(policy.ok(), "fixture policy: %s", policy.status().ToString().c_str());
  for (uint32_t i = 0; i < num_shards; ++i) {
    auto store = server::ParameterStore::Load(source, i, num_shards, *policy);
    FUZZ_CHECK(store.ok(), "fixture store: %s", store.status().ToString().c_str());
    set.shards.push_back(*std::move(store));
  }
  return set;
}

const std::vector<ShardSet>& ShardSets() {
  static const std::vector<ShardSet>* sets = [] {
    static const auto synthetic = SyntheticModel::Create("llama:layers=2,hidden=8,ffn=12,vocab=10");
    FUZZ_CHECK(synthetic.ok(), "fixture model: %s", synthetic.status().ToString().c_str());
    static const AwkwardModel awkward;
    auto* out = new std::vector<ShardSet>();
    out->push_back(Load("llama/3", **synthetic, "p=f32,c=bf16;*norm*=f32", 3));
    out->push_back(Load("awkward/4", awkward, "c=f16;tiny=f32;zero=bf16;*norm=bf16", 4));
    out->push_back(Load("awkward/1", awkward, "f32", 1));
    out->push_back(Load("llama/2-f16", **synthetic, "p=f32,c=f16", 2));
    return out;
  }();
  return *sets;
}

// The elements of each tensor the request selects: what all shards together
// must send.
std::vector<ElementRange> Selected(const AssembledLayout& layout,
                                   const layercast::v1::FetchLayerRequest& request) {
  std::vector<ElementRange> selected(layout.tensors().size());
  if (request.range_begin() == 0 && request.range_end() == 0) {
    for (size_t t = 0; t < selected.size(); ++t) {
      selected[t] = {0, layout.tensors()[t].num_elements};
    }
    return selected;
  }
  auto ranges = layout.MapByteRange(request.range_begin(), request.range_end());
  FUZZ_CHECK(ranges.ok(), "a plan was made for a range the layout refuses: %s",
             ranges.status().ToString().c_str());
  for (const TensorElementRange& range : *ranges) selected[range.tensor] = range.elements;
  return selected;
}

void CheckSet(const ShardSet& set, const layercast::v1::FetchLayerRequest& request) {
  const server::ParameterStore& first = *set.shards[0];
  const bool layer_exists = request.layer() < first.model().layers.size();
  std::vector<absl::StatusOr<server::FetchPlan>> plans;
  for (const auto& store : set.shards) plans.push_back(server::PlanFetch(*store, request));

  for (size_t i = 0; i < plans.size(); ++i) {
    FUZZ_CHECK(plans[i].status().code() == plans[0].status().code(),
               "%s: shard %zu says %s, shard 0 says %s", set.name.c_str(), i,
               plans[i].status().ToString().c_str(), plans[0].status().ToString().c_str());
  }
  if (!plans[0].ok()) {
    const absl::Status& status = plans[0].status();
    FUZZ_CHECK((status.code() == absl::StatusCode::kNotFound) == !layer_exists,
               "%s: layer %u of %zu refused with %s", set.name.c_str(), request.layer(),
               first.model().layers.size(), status.ToString().c_str());
    // OUT_OF_RANGE only for a delta (a dtype of its own, or 8-bit codes,
    // have none).
    FUZZ_CHECK(status.code() == absl::StatusCode::kNotFound ||
                   status.code() == absl::StatusCode::kInvalidArgument ||
                   status.code() == absl::StatusCode::kFailedPrecondition ||
                   (status.code() == absl::StatusCode::kOutOfRange && request.has_base_version()),
               "%s: refused with %s", set.name.c_str(), status.ToString().c_str());
    FUZZ_CHECK(!status.message().empty(), "%s: refused without a message", set.name.c_str());
    return;
  }
  FUZZ_CHECK(layer_exists, "%s: planned layer %u of %zu", set.name.c_str(), request.layer(),
             first.model().layers.size());

  const uint32_t layer = request.layer();
  // The policy's layout, or every tensor in the request's dtype.
  const AssembledLayout& layout = plans[0]->layout;
  FUZZ_CHECK(layout.tensors().size() == first.layout(layer).tensors().size(),
             "%s: the plan's layout has %zu tensors, the layer %zu", set.name.c_str(),
             layout.tensors().size(), first.layout(layer).tensors().size());
  const size_t num_tensors = first.model().layers[layer].tensors.size();
  const std::vector<ElementRange> selected = Selected(layout, request);
  std::vector<std::vector<ElementRange>> sent(num_tensors);
  for (size_t i = 0; i < plans.size(); ++i) {
    const server::FetchPlan& plan = *plans[i];
    FUZZ_CHECK(plan.layer == layer, "%s: shard %zu planned layer %u for %u", set.name.c_str(), i,
               plan.layer, layer);
    uint64_t bytes = 0;
    for (size_t r = 0; r < plan.runs.size(); ++r) {
      const TensorElementRange& run = plan.runs[r];
      FUZZ_CHECK(run.tensor < num_tensors, "%s: shard %zu run in tensor %u of %zu",
                 set.name.c_str(), i, run.tensor, num_tensors);
      FUZZ_CHECK(r == 0 || plan.runs[r - 1].tensor < run.tensor,
                 "%s: shard %zu runs out of tensor order", set.name.c_str(), i);
      const ElementRange owned = set.shards[i]->owned(layer, run.tensor);
      FUZZ_CHECK(!run.elements.empty() && run.elements.begin >= owned.begin &&
                     run.elements.end <= owned.end,
                 "%s: shard %zu run [%llu, %llu) of tensor %u outside owned [%llu, %llu)",
                 set.name.c_str(), i, static_cast<unsigned long long>(run.elements.begin),
                 static_cast<unsigned long long>(run.elements.end), run.tensor,
                 static_cast<unsigned long long>(owned.begin),
                 static_cast<unsigned long long>(owned.end));
      FUZZ_CHECK(run.elements.end <= layout.tensors()[run.tensor].num_elements,
                 "%s: shard %zu run beyond tensor %u", set.name.c_str(), i, run.tensor);
      const AssembledTensor& placed = layout.tensors()[run.tensor];
      FUZZ_CHECK(plan.layout.tensors()[run.tensor].compute_dtype == placed.compute_dtype &&
                     plan.layout.total_bytes() == layout.total_bytes(),
                 "%s: shard %zu lays the layer out unlike shard 0", set.name.c_str(), i);
      bytes += run.elements.size() * DTypeSize(placed.compute_dtype);
      if (placed.block_size != 0) {  // and the scale of every block it touches
        bytes += ((run.elements.end + placed.block_size - 1) / placed.block_size -
                  run.elements.begin / placed.block_size) *
                 sizeof(float);
      }
      sent[run.tensor].push_back(run.elements);
    }
    FUZZ_CHECK(bytes == plan.bytes, "%s: shard %zu plan says %llu bytes, its runs hold %llu",
               set.name.c_str(), i, static_cast<unsigned long long>(plan.bytes),
               static_cast<unsigned long long>(bytes));
  }
  for (size_t t = 0; t < num_tensors; ++t) {
    std::vector<ElementRange>& runs = sent[t];
    std::sort(runs.begin(), runs.end(),
              [](const ElementRange& a, const ElementRange& b) { return a.begin < b.begin; });
    // Together: exactly selected[t], contiguous, no element twice.
    uint64_t next = selected[t].begin;
    for (const ElementRange& run : runs) {
      FUZZ_CHECK(run.begin == next, "%s: tensor %zu gap or overlap at element %llu",
                 set.name.c_str(), t, static_cast<unsigned long long>(next));
      next = run.end;
    }
    FUZZ_CHECK(next == std::max(selected[t].begin, selected[t].end),
               "%s: tensor %zu covered to %llu of [%llu, %llu)", set.name.c_str(), t,
               static_cast<unsigned long long>(next),
               static_cast<unsigned long long>(selected[t].begin),
               static_cast<unsigned long long>(selected[t].end));
  }
}

// A delta's base_incarnation names one start of one shard (random, so no
// two shards share it): a shard of another incarnation refuses the delta
// with OUT_OF_RANGE, whatever else the request says; the checks above run
// on the request without it.
void CheckIncarnation(const ShardSet& set, const layercast::v1::FetchLayerRequest& request) {
  if (!request.has_base_version() || !request.has_base_incarnation()) return;
  layercast::v1::FetchLayerRequest without = request;
  without.clear_base_incarnation();
  for (const auto& store : set.shards) {
    const absl::StatusOr<server::FetchPlan> plain = server::PlanFetch(*store, without);
    const absl::StatusOr<server::FetchPlan> named = server::PlanFetch(*store, request);
    if (!plain.ok() || request.base_incarnation() == store->incarnation()) {
      FUZZ_CHECK(named.status().code() == plain.status().code(),
                 "%s: %s with the incarnation, %s without", set.name.c_str(),
                 named.status().ToString().c_str(), plain.status().ToString().c_str());
    } else {
      FUZZ_CHECK(named.status().code() == absl::StatusCode::kOutOfRange,
                 "%s: a delta from another incarnation answered %s", set.name.c_str(),
                 named.status().ToString().c_str());
    }
  }
}

}  // namespace
}  // namespace layercast::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  layercast::v1::FetchLayerRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  layercast::v1::FetchLayerRequest same_start = request;
  same_start.clear_base_incarnation();
  for (const layercast::fuzz::ShardSet& set : layercast::fuzz::ShardSets()) {
    layercast::fuzz::CheckSet(set, same_start);
    layercast::fuzz::CheckIncarnation(set, request);
  }
  return 0;
}
