// The model id a server answers to and reports: `--served-model-name`, else the model directory's
// last component (vLLM's default). One rule for the router's APIs, the decode node's metrics and
// `fluxion local`'s closing request.
#ifndef FLUXION_COMMON_SERVED_MODEL_NAME_H_
#define FLUXION_COMMON_SERVED_MODEL_NAME_H_

#include <string>

namespace fluxion {

inline std::string ServedModelName(const std::string& served_model_name,
                                   const std::string& model_dir) {
  if (!served_model_name.empty()) return served_model_name;
  std::string dir = model_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir.substr(dir.rfind('/') + 1);
}

}  // namespace fluxion

#endif  // FLUXION_COMMON_SERVED_MODEL_NAME_H_
