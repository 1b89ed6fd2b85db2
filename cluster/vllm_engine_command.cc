#include "cluster/vllm_engine_command.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::cluster {

void VllmEngineSetup::Connect(grpc::Server* server) {
  service_->Connect(server->InProcessChannel(grpc::ChannelArguments()));
}

absl::StatusOr<std::unique_ptr<VllmEngineSetup>> MakeVllmEngineService(
    const VllmEngineFlags& flags, std::function<bool()> healthy) {
  auto setup = std::unique_ptr<VllmEngineSetup>(new VllmEngineSetup());
  VllmEngineOptions options;
  options.healthy = std::move(healthy);
  if (!flags.model_dir.empty()) {
    if (flags.tokenizer == nullptr) {
      return absl::InvalidArgumentError("--model-dir given without its tokenizer loaded");
    }
    setup->tokenizer_ = flags.tokenizer;
    auto config = model::LoadModelConfig(flags.model_dir + "/config.json");
    if (!config.ok()) {
      return absl::Status(config.status().code(),
                          absl::StrCat("--model-dir: ", config.status().message()));
    }
    options.model_dir = flags.model_dir;
    options.served_model_name = flags.served_model_name;
    options.tokenizer = setup->tokenizer_.get();
    options.config = std::move(*config);
  }
  setup->service_ = std::make_unique<VllmEngineService>(std::move(options));
  return setup;
}

}  // namespace fluxion::cluster
