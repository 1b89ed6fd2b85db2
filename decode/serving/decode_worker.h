// The decode node's composition root (`fluxion decode`): built from one DecodeWorkerConfig, it
// owns every part of the node (model, UCX transport, KV arena and its registration, admission,
// step executor, batch scheduler, DecodeService, metrics and the gRPC server) and their order of
// start and stop. The command only maps flags to the config (decode/serving/serve_command.cc).
//
// Thread-compatible: one thread creates, serves and shuts the worker down.
#ifndef FLUXION_DECODE_SERVING_DECODE_WORKER_H_
#define FLUXION_DECODE_SERVING_DECODE_WORKER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/grpc_security.h"
#include "common/grpc_serve.h"
#include "decode/kv/kv_admission.h"
#include "decode/kv/kv_arena.h"
#include "decode/serving/batch_scheduler.h"
#include "decode/serving/decode_metrics.h"
#include "decode/serving/decode_service.h"
#include "decode/serving/prefill_peers.h"
#include "decode/sparse/error_guard.h"
#include "decode/sparse/fluxion_predictor.h"
#include "decode/sparse/policy.h"
#include "decode/step/step_executor.h"
#include "decode/step/step_executor_factory.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/model.h"
#include "transfer/transport.h"
#include "transfer/ucx_flags.h"

namespace fluxion::decode {

// Everything a decode node is built from; the flags of `fluxion decode` say what each means.
struct DecodeWorkerConfig {
  std::string model_dir;
  // The longest context (prompt plus generated tokens) this node accepts: 0 = the model's
  // max_position_embeddings; more than that is refused at start-up (--max-model-len).
  int64_t max_model_len = 0;
  // The model's name in metrics (fluxion_model_info's model_name): the router's
  // --served-model-name; empty: the model directory's name, as the router defaults it.
  std::string served_model_name;
  std::string node_name;  // empty: decode@<host>/<pid>/<unix ms>
  // The process's CPU pool, set up by the command before any thread starts (process_cpu.h).
  kernels::cpu::CpuPool cpu_pool{1};

  // Serving: listen address, port files, /metrics (serve.credentials: Create builds them from
  // `tls`).
  serving::ServeConfig serve;
  serving::ServerTlsOptions tls;
  int64_t drain_timeout_ms = 30000;

  // Prefill nodes and the transfer from them.
  std::vector<std::string> prefill_addresses, prefill_dns;
  serving::ClientTlsOptions prefill_tls;
  std::string transfer_secret_file;
  transfer::UcxFlags ucx;
  int64_t prefill_timeout_ms = 120000, abort_wait_ms = 2000, quarantine_ms = 30000;

  // The KV arena and admission into it.
  int64_t page_tokens = 16, kv_pages = 65536, headroom_tokens = 64, max_waiting = 64;
  int64_t admission_timeout_ms = 10000;
  bool huge_pages = true;

  // Sparse attention: defaults for requests that name none, and the policies' inputs.
  std::string default_policy = "fluxion";
  double default_budget = 0.1;
  std::string fluxion_predictor;  // --fluxion-predictor: path, "none", or empty (the model's)
  double host_read_gbps = 0;      // 0: measured at start-up
  sparse::Selector selector = sparse::Selector::kDevice;  // used with StepDevice::kCuda only
  sparse::GuardConfig guard;                              // `enabled` from --guard

  // How steps run (decode/step/step_executor_factory.h); cuda.compact_slots is sized here from
  // device_selection_gib.
  StepExecutorOptions steps;
  double device_selection_gib = 16;
  int64_t step_delay_ms = 0;  // fault injection for tests
};

// InvalidArgument, naming the flag, for a config no worker can be built from (checked before
// anything is loaded).
absl::Status ValidateDecodeWorkerConfig(const DecodeWorkerConfig& config);

class DecodeWorker {
 public:
  // Builds the node: reads the secret and certificates, loads the model, starts UCX, creates
  // and registers the arena, builds the step executor and the service. InvalidArgument for a
  // bad config, file or prefill address (the command's exit code 2); any other code when a part
  // cannot be had (the model, UCX, the arena, the device).
  static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(DecodeWorkerConfig config);
  // Shuts down (Shutdown) if still serving.
  ~DecodeWorker();
  DecodeWorker(const DecodeWorker&) = delete;
  DecodeWorker& operator=(const DecodeWorker&) = delete;

  // Starts the gRPC server and /metrics, marks the service SERVING and writes the port files.
  // Unavailable when a port cannot be bound.
  absl::Status Start();
  // Start, then blocks until SIGTERM or SIGINT, then Shutdown.
  absl::Status Serve();
  // The drain (docs/SERVING.md): NOT_SERVING, new requests refused, running ones get
  // --drain-timeout-ms, then the rest end with UNAVAILABLE; then the servers stop. Returns the
  // requests still live at the timeout. Idempotent; 0 when not serving.
  int64_t Shutdown();

  int port() const { return serve_ != nullptr ? serve_->port() : 0; }

 private:
  explicit DecodeWorker(DecodeWorkerConfig config) : config_(std::move(config)) {}
  // The phases of Create, in order.
  absl::Status ReadSecretsAndPeers();
  absl::Status LoadModel();
  absl::Status CreateArena();
  absl::Status BuildService();
  void PrintServing() const;

  DecodeWorkerConfig config_;
  // Read from files before the model: a bad path fails in a second, not a minute.
  std::shared_ptr<const proto::TransferSecret> transfer_secret_;
  serving::ChannelConfig prefill_channel_;
  std::shared_ptr<PrefillPeers> prefill_peers_;
  std::shared_ptr<const sparse::FluxionPredictor> predictor_;
  // Declared in the order they are built, so they are destroyed in reverse: the registration
  // before the arena, the arena before the transport, the service before what it borrows.
  std::unique_ptr<model::Model> model_;
  int64_t context_limit_ = 0;  // --max-model-len, else the model's max_position_embeddings
  std::vector<int64_t> generation_eos_ids_;  // generation_config.json's eos_token_id
  fluxion::v1::ModelLayout layout_;
  std::unique_ptr<transfer::Transport> transport_;
  std::unique_ptr<KvArena> arena_;
  std::unique_ptr<transfer::Registration> registration_;
  transfer::PeerDescriptor descriptor_;
  std::unique_ptr<DecodeNodeMetrics> node_metrics_;
  std::unique_ptr<KvAdmission> admission_;
  std::unique_ptr<StepExecutor> executor_;
  int64_t compact_places_ = 0;  // device-selection places of the step executor (0: none)
  std::unique_ptr<BatchScheduler> scheduler_;
  std::unique_ptr<DecodeServiceImpl> service_;
  // Last: stops serving before anything its calls and scrapes read goes away.
  std::unique_ptr<serving::GrpcServe> serve_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_DECODE_WORKER_H_
