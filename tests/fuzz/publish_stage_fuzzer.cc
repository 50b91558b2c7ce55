// Fuzzes the shard's publish staging (Publications::Stage, which a
// StagePublish stream feeds every PublishChunk a publisher sends, and the
// Commit after it) on a real ParameterStore. Properties: whatever the bytes,
// staging writes only inside the publish's fp32 staging (AddressSanitizer);
// Stage refuses only with the codes its header names and Commit with
// FAILED_PRECONDITION; a commit takes only a publish whose every owned
// element was staged; after it, or after an abort, the staging's budget is
// back and the publish takes no more chunks.
//
// Input: byte 0's bit 0 gives every chunk the open publish's id (else the
// chunk's own), bit 1 begins a publish of layer 0 only (else of every
// layer); then frames, each a 2-byte little-endian length and that many
// bytes of a serialized PublishChunk. The fixture: shard 1 of 2 of
// PublishStageFixture() (publish_stage_fixture.h).

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <memory>

#include "server/publishing/publication.h"
#include "server/serving/memory_budget.h"
#include "server/serving/version_gate.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/publish_stage_fixture.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace layercast;
  if (size < 1) return 0;
  server::ParameterStore& store = fuzz::PublishStageFixture();
  boost::asio::io_context grants;
  server::VersionGate gate(grants.get_executor());
  gate.SetLayers(static_cast<uint32_t>(store.model().layers.size()));
  server::MemoryBudget budget(std::nullopt, 0, grants.get_executor());
  const uint64_t idle = budget.in_use();
  auto publications =
      std::make_unique<server::Publications>(server::Publications::Links{&store, &gate, &budget});

  const bool right_id = data[0] & 1;
  layercast::v1::BeginPublishRequest begin;
  begin.set_publish_id("p");
  begin.set_base_version(0);
  if (data[0] & 2) begin.add_layers(0);
  const absl::StatusOr<uint64_t> staging = publications->Begin(begin);
  FUZZ_CHECK(staging.ok(), "the fixture's publish was refused: %s",
             staging.status().ToString().c_str());

  size_t at = 1;
  while (at + 2 <= size) {
    const size_t length = std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
    at += 2;
    layercast::v1::PublishChunk chunk;
    if (!chunk.ParseFromArray(data + at, static_cast<int>(length))) {
      at += length;
      continue;
    }
    at += length;
    if (right_id) chunk.set_publish_id("p");
    const absl::Status staged = publications->Stage(chunk);
    FUZZ_CHECK(staged.ok() || staged.code() == absl::StatusCode::kNotFound ||
                   staged.code() == absl::StatusCode::kInvalidArgument ||
                   staged.code() == absl::StatusCode::kDataLoss,
               "Stage answered %s", staged.ToString().c_str());
  }
  const absl::StatusOr<server::Publications::Committed> committed = publications->Commit("p");
  FUZZ_CHECK(committed.ok() || committed.status().code() == absl::StatusCode::kFailedPrecondition,
             "Commit answered %s", committed.status().ToString().c_str());
  if (committed.ok()) {
    FUZZ_CHECK(committed->version == 1, "committed version %llu",
               static_cast<unsigned long long>(committed->version));
    FUZZ_CHECK(budget.in_use() == idle, "the staging's budget is not back after the commit");
    layercast::v1::PublishChunk late;
    late.set_publish_id("p");
    FUZZ_CHECK(publications->Stage(late).code() == absl::StatusCode::kNotFound,
               "a committed publish took another chunk");
  } else {
    publications->Abort("p");
    FUZZ_CHECK(budget.in_use() == idle, "the staging's budget is not back after the abort");
  }
  publications.reset();
  // Drain what the gate and budget posted (nothing waits on them here).
  grants.run();
  return 0;
}
