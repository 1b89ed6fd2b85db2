// libFuzzer target: config.json text -> ParseModelConfig. Any input must give a config or an
// error status: no crash, no sanitizer report, no unbounded allocation. docs/FUZZING.md.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<fluxion::model::ModelConfig> config = fluxion::model::ParseModelConfig(text);
  if (config.ok()) {
    // An accepted config must serialise and read back (make-model writes what it accepted).
    absl::StatusOr<fluxion::model::ModelConfig> again =
        fluxion::model::ParseModelConfig(fluxion::model::ModelConfigToJson(*config));
    if (!again.ok()) __builtin_trap();
  }
  return 0;
}
