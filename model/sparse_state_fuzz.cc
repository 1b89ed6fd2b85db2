// libFuzzer target: sparse-state wire bytes (model/sparse_state.h, docs/SPARSE_STATE.md) ->
// SparseState::Parse. An accepted state must re-serialise to the same bytes, and CheckMatches
// against its own shape must pass. docs/FUZZING.md.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "model/sparse_state.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<fluxion::model::SparseState> state = fluxion::model::SparseState::Parse(bytes);
  if (!state.ok()) return 0;
  // Serialize writes the reserved header word (bytes 20..23) as 0; Parse ignores it.
  std::string expected(bytes);
  if (expected.size() >= 24) expected.replace(20, 4, 4, '\0');
  if (state->Serialize() != expected) __builtin_trap();
  const fluxion::model::AttentionShape shape{state->num_layers,
                                             state->num_kv_heads * state->group,
                                             state->num_kv_heads, 1, 1.0f};
  if (!state->CheckMatches(shape, state->tokens).ok()) __builtin_trap();
  return 0;
}
