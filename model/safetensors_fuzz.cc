// libFuzzer target: a whole safetensors file image (length prefix, header JSON, data) ->
// ParseSafetensorsBytes, then every accepted tensor through ReadAsFloat. Any input must give views
// that stay inside the image or an error status. docs/FUZZING.md.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "absl/strings/string_view.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view image(reinterpret_cast<const char*>(data), size);
  std::map<std::string, fluxion::model::TensorView> tensors;
  std::map<std::string, std::string> metadata;
  if (!fluxion::model::ParseSafetensorsBytes(image, &tensors, &metadata).ok()) return 0;
  for (const auto& [name, view] : tensors) {
    if (view.data < data || view.data + view.nbytes > data + size) __builtin_trap();
    // Reads every byte of the view (ASan checks each one); the shape is the view's own.
    (void)fluxion::model::ReadAsFloat(view, view.shape);
  }
  return 0;
}
