// libFuzzer target: PrefillRequest protobuf bytes -> ParseFromArray -> ValidatePrefillRequest
// (prefill/prefill_validation.h) with the tiny preset's limits. An accepted request must name
// exactly the pages its prompt needs, each inside the arena it declares. docs/FUZZING.md.
#include <cstddef>
#include <cstdint>

#include "fluxion/v1/prefill.pb.h"
#include "model/random_model.h"
#include "prefill/prefill_validation.h"
#include "proto/convert.h"
#include "transfer/page_meta.h"

namespace {

struct Fixture {
  Fixture() {
    config = *fluxion::model::PresetConfig("tiny");
    layout = fluxion::proto::LayoutFor(config, "tiny", "crc32c-00000000", 16);
    limits.vocab_size = config.vocab_size;
    limits.context_limit = config.max_position_embeddings;
    limits.shape = {config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
                    0.25f};
    limits.layout = &layout;
    limits.transport_kind = "loopback";
  }
  fluxion::model::ModelConfig config;
  fluxion::v1::ModelLayout layout;
  fluxion::prefill::PrefillLimits limits;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Fixture* const fixture = new Fixture();
  fluxion::v1::PrefillRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<fluxion::prefill::ValidatedPrefill> valid =
      fluxion::prefill::ValidatePrefillRequest(request, fixture->limits);
  if (!valid.ok()) return 0;
  const int64_t n = request.prompt_token_ids_size();
  if (static_cast<int64_t>(valid->page_ids.size()) != valid->geo.total_pages(n)) __builtin_trap();
  const uint64_t capacity = valid->arena_bytes / request.kv_target().page_bytes();
  for (uint64_t id : valid->page_ids) {
    if (id >= capacity) __builtin_trap();
  }
  // Accepted page metadata: a target per extent, and room for the whole stream.
  if (valid->want_meta) {
    const fluxion::v1::PageMetaTarget& mt = request.page_meta_target();
    if (static_cast<int>(valid->meta_target.size()) != mt.extents_size()) __builtin_trap();
    uint64_t room = 0;
    for (int i = 0; i < mt.extents_size(); ++i) {
      if (static_cast<int>(valid->meta_target[i]) >= valid->targets) __builtin_trap();
      room += mt.extents(i).length();
    }
    if (room < fluxion::transfer::PageMetaBytes(valid->geo, n)) __builtin_trap();
  }
  return 0;
}
