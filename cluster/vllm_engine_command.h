// The router's VllmEngine service as the `fluxion router` command sets it up: the tokenizer and
// config it loads from the router's --model-dir, and the service, owned together.
#ifndef FLUXION_CLUSTER_VLLM_ENGINE_COMMAND_H_
#define FLUXION_CLUSTER_VLLM_ENGINE_COMMAND_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cluster/vllm_engine_service.h"
#include "model/tokenizer.h"
#include "common/flag_set.h"
#include "grpcpp/grpcpp.h"

namespace fluxion::cluster {

inline constexpr char kVllmEngineServiceName[] = "vllm.grpc.engine.VllmEngine";

struct VllmEngineFlags {
  std::string model_dir;  // the router's --model-dir (router_command.cc registers it once)
  std::string served_model_name;  // what the HTTP API answers to (ServedModelName)
  // Its tokenizer, loaded once by the router for both text front ends (null without model_dir).
  std::shared_ptr<const model::Tokenizer> tokenizer;
};

class VllmEngineSetup {
 public:
  grpc::Service* service() { return service_.get(); }
  // Points the service at the router's DecodeService on `server` (in process).
  void Connect(grpc::Server* server);

 private:
  friend absl::StatusOr<std::unique_ptr<VllmEngineSetup>> MakeVllmEngineService(
      const VllmEngineFlags&, std::function<bool()>);
  std::shared_ptr<const model::Tokenizer> tokenizer_;
  std::unique_ptr<VllmEngineService> service_;
};

// Loads --model-dir's config.json when the flag is set (errors name the flag); REQUIRES the
// flags' tokenizer then.
// `healthy` answers HealthCheck.
absl::StatusOr<std::unique_ptr<VllmEngineSetup>> MakeVllmEngineService(
    const VllmEngineFlags& flags, std::function<bool()> healthy);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_VLLM_ENGINE_COMMAND_H_
