// The prefill node's composition root (`fluxion prefill`): built from one PrefillWorkerConfig, it
// owns every part of the node (model, UCX transport, the GPU forward when asked for, the engine,
// PrefillService, metrics and the gRPC server) and their order of start and stop. The command
// only maps flags to the config (prefill/commands.cc).
//
// Thread-compatible: one thread creates, serves and shuts the worker down.
#ifndef FLUXION_PREFILL_PREFILL_WORKER_H_
#define FLUXION_PREFILL_PREFILL_WORKER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/grpc_security.h"
#include "common/grpc_serve.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/model.h"
#include "prefill/device_prefill.h"
#include "prefill/prefill_engine.h"
#include "prefill/prefill_metrics.h"
#include "prefill/prefill_service.h"
#include "transfer/transport.h"
#include "transfer/ucx_flags.h"

namespace fluxion::prefill {

// Where the forward runs.
enum class ForwardDevice {
  kCpu,   // the batched CPU forward of PrefillEngine
  kCuda,  // GPU 0 (prefill/device_prefill.h): bf16 weights in HBM, pages copied to the host
};
// "cpu" or "cuda"; InvalidArgument naming --device otherwise.
absl::StatusOr<ForwardDevice> ParseForwardDevice(const std::string& name);

// Everything a prefill node is built from; the flags of `fluxion prefill` say what each means.
struct PrefillWorkerConfig {
  std::string model_dir;
  std::string node_name;  // empty: prefill@<host>/<pid>/<unix ms>
  // The process's CPU pool and malloc arena cap (0: glibc's default), both set up by the command
  // before any thread starts.
  kernels::cpu::CpuPool cpu_pool{1};
  int64_t malloc_arenas = 0;

  serving::ServeConfig serve;  // serve.credentials: Create builds them from `tls`
  serving::ServerTlsOptions tls;
  int64_t drain_timeout_ms = 30000;
  std::string transfer_secret_file;
  transfer::UcxFlags ucx;

  ForwardDevice device = ForwardDevice::kCpu;
  int64_t device_chunk_tokens = DevicePrefillOptions{}.chunk_tokens;
  int64_t device_staging_tokens = -1;  // -1: the model's context length
  int64_t staging_ring_mib = static_cast<int64_t>(PrefillEngineOptions{}.staging_ring_bytes >> 20);
  int64_t page_tokens = 16;
  bool layerwise = true;
  int64_t transfer_timeout_ms = 30000, layer_delay_ms = 0, piece_tokens = 512;
  int64_t max_batch_tokens = -1;  // -1: the device's default (kCpuMaxBatchTokens and so on)
  int64_t max_queued_requests = PrefillServiceImpl::kDefaultMaxQueuedRequests;
};

class PrefillWorker {
 public:
  // Builds the node: reads the secret and certificates, loads the model (and uploads it to the
  // GPU with ForwardDevice::kCuda), starts UCX, builds the engine and the service.
  // InvalidArgument for a bad config or file (the command's exit code 2); any other code when a
  // part cannot be had (the model, UCX, the device).
  static absl::StatusOr<std::unique_ptr<PrefillWorker>> Create(PrefillWorkerConfig config);
  // Shuts down (Shutdown) if still serving.
  ~PrefillWorker();
  PrefillWorker(const PrefillWorker&) = delete;
  PrefillWorker& operator=(const PrefillWorker&) = delete;

  // Starts the gRPC server and /metrics, marks the service SERVING and writes the port files.
  // Unavailable when a port cannot be bound.
  absl::Status Start();
  // Start, then blocks until SIGTERM or SIGINT, then Shutdown.
  absl::Status Serve();
  // The drain: NOT_SERVING, new calls refused, running ones get --drain-timeout-ms; calls still
  // open then are cancelled by the shutdown, which their decode nodes see as a failed Prefill
  // call (docs/SERVING.md, "How a Prefill call ends"). Returns the calls live at the timeout.
  // Idempotent; 0 when not serving.
  int64_t Shutdown();

  int port() const { return serve_ != nullptr ? serve_->port() : 0; }

 private:
  explicit PrefillWorker(PrefillWorkerConfig config) : config_(std::move(config)) {}
  // The phases of Create, in order.
  absl::Status LoadModel();
  absl::Status StartDevice(const PrefillEngineOptions& options);
  absl::Status BuildService(const PrefillEngineOptions& options);
  int64_t MaxBatchTokens() const;

  PrefillWorkerConfig config_;
  // Declared in the order they are built, so they are destroyed in reverse: the service before
  // the engine, the engine before the device and the transport it borrows.
  std::unique_ptr<model::Model> model_;  // null once the GPU holds its own copy
  model::ModelConfig model_config_;
  fluxion::v1::ModelLayout layout_;
  std::unique_ptr<transfer::Transport> transport_;
  std::unique_ptr<DevicePrefill> gpu_;  // with ForwardDevice::kCuda
  std::unique_ptr<PrefillEngine> engine_;
  std::unique_ptr<PrefillNodeMetrics> node_metrics_;
  std::unique_ptr<PrefillServiceImpl> service_;
  // Last: stops serving before anything its calls and scrapes read goes away.
  std::unique_ptr<serving::GrpcServe> serve_;
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_PREFILL_WORKER_H_
