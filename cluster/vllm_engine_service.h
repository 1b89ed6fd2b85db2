// vllm.grpc.engine.VllmEngine on the router (issue 16): the engine protocol SMG and vllm-router
// gateways route to, so Fluxion drops into those clusters as one "engine". It is a client of the
// router's own fluxion.v1.DecodeService through the gRPC server's in-process channel, so routing,
// retries, deadlines, shedding and cancellation are the router's one implementation; this class
// only translates (cluster/vllm_engine_mapping.h) and keeps request ids for Abort.
//
//   SMG --VllmEngine.Generate--> [this] --in-process DecodeService.Generate--> RouterService
//
// The mapping of every RPC and field is docs/PROTOCOL.md, "VllmEngine".
//
// Thread-safe. Reactors never block.
#ifndef FLUXION_CLUSTER_VLLM_ENGINE_SERVICE_H_
#define FLUXION_CLUSTER_VLLM_ENGINE_SERVICE_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "model/config.h"
#include "model/tokenizer.h"
#include "vllm/grpc/engine/vllm_engine.grpc.pb.h"

namespace fluxion::cluster {

struct VllmEngineOptions {
  // The router's model directory (--model-dir): its tokenizer turns text input into ids and its
  // config.json answers GetModelInfo. Both absent: token ids only.
  std::string model_dir;
  // The model id the router's APIs answer to (its --served-model-name, else the directory's
  // name: what GET /v1/models lists); empty: the decode nodes' layout's model id.
  std::string served_model_name;
  const model::Tokenizer* tokenizer = nullptr;  // must outlive the service
  std::optional<model::ModelConfig> config;
  // HealthCheck's answer: whether the router can serve now (a healthy decode node).
  std::function<bool()> healthy;
};

class VllmEngineService final : public vllm::grpc::engine::VllmEngine::CallbackService {
 public:
  explicit VllmEngineService(VllmEngineOptions options);
  ~VllmEngineService() override;

  // The router's DecodeService, reached in process (grpc::Server::InProcessChannel). Set once,
  // after the server that serves both started and before it takes calls of this service (until
  // then they answer UNAVAILABLE).
  void Connect(std::shared_ptr<grpc::Channel> channel);

  grpc::ServerWriteReactor<vllm::grpc::engine::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context,
      const vllm::grpc::engine::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* HealthCheck(grpc::CallbackServerContext* context,
                                        const vllm::grpc::engine::HealthCheckRequest* request,
                                        vllm::grpc::engine::HealthCheckResponse* response) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const vllm::grpc::engine::AbortRequest* request,
                                  vllm::grpc::engine::AbortResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(
      grpc::CallbackServerContext* context, const vllm::grpc::engine::GetModelInfoRequest* request,
      vllm::grpc::engine::GetModelInfoResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(
      grpc::CallbackServerContext* context, const vllm::grpc::engine::GetServerInfoRequest* request,
      vllm::grpc::engine::GetServerInfoResponse* response) override;
  grpc::ServerUnaryReactor* GetLoads(grpc::CallbackServerContext* context,
                                     const vllm::grpc::engine::GetLoadsRequest* request,
                                     vllm::grpc::engine::GetLoadsResponse* response) override;

  // Generate calls open now (tests).
  int open_calls() const;

 private:
  class GenerateCall;
  friend class GenerateCall;

  v1::DecodeService::Stub* stub() const;
  // Asks the router for its DecodeLoad; `done` runs with it or the call's status.
  void FetchLoad(grpc::CallbackServerContext* context,
                 std::function<void(const grpc::Status&, const v1::DecodeLoad&)> done);
  // Sends fluxion.v1 Abort for one request with the router's abort token (fire and forget).
  void SendAbort(const std::string& request_id, const std::string& token);

  void AddLive(const std::string& id, GenerateCall* call);
  void RemoveLive(const std::string& id, GenerateCall* call);

  const VllmEngineOptions options_;
  const absl::Time start_ = absl::Now();
  mutable absl::Mutex mu_;
  std::shared_ptr<grpc::Channel> channel_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<v1::DecodeService::Stub> stub_ ABSL_GUARDED_BY(mu_);
  // Live Generate calls by their request id (ids may repeat; Abort ends every call with the id).
  std::multimap<std::string, GenerateCall*> live_ ABSL_GUARDED_BY(mu_);
  absl::Time last_receive_ ABSL_GUARDED_BY(mu_) = absl::UnixEpoch();
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_VLLM_ENGINE_SERVICE_H_
