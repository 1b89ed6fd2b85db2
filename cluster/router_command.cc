#include "cluster/router_command.h"

#include <iostream>

#include "cluster/openai_serving.h"
#include "cluster/router_server.h"
#include "common/flag_set.h"
#include "common/grpc_security.h"
#include "common/grpc_serve.h"

namespace fluxion::cluster {
namespace {

void RegisterBackendFlags(FlagSet& flags, RouterServerConfig* c) {
  flags.StringList("decode", &c->decode, "decode nodes, host:port, comma-separated");
  flags.StringList("prefill", &c->prefill, "prefill nodes, host:port, comma-separated");
  flags.StringList(
      "decode-dns", &c->decode_dns,
      "DNS names of decode nodes, name:port (every A record, e.g. a headless service)");
  flags.StringList("prefill-dns", &c->prefill_dns, "DNS names of prefill nodes, name:port");
  flags.Int("poll-ms", &c->poll_ms, "health check and GetLoad interval");
  flags.Int("health-failures", &c->health_failures,
            "drop a node after this many health checks in a row got no answer in time (a "
            "NOT_SERVING or draining answer drops it at once)");
  flags.Int("health-successes", &c->health_successes,
            "take a dropped node back after this many passing health checks in a row (a node "
            "never seen healthy joins on its first)");
  flags.Double("shed-kv-usage", &c->shed_kv_usage,
               "refuse requests (RESOURCE_EXHAUSTED) when every decode node's KV usage is at or "
               "above this fraction");
  flags.Int("max-attempts", &c->max_attempts,
            "tries per request, each on another decode node, only before the first token");
  flags.Int("deadline-grace-ms", &c->deadline_grace_ms,
            "each attempt's gRPC deadline is the request's budget plus this, so the decode "
            "node's own DEADLINE_EXCEEDED message (usage, timing) reaches the client first");
}

void RegisterServingFlags(FlagSet& flags, RouterServerConfig* c) {
  flags.Int("drain-timeout-ms", &c->drain_timeout_ms,
            "on SIGTERM: readiness NOT_SERVING (liveness stays SERVING), new requests refused "
            "(UNAVAILABLE; HTTP 503), open ones get this long to finish; then they are aborted "
            "(their streams end with the tokens so far and finish reason abort) and the process "
            "exits within 3 s more");
  flags.String("node-name", &c->node_name, "name in GetLoad (default: hostname/start time)");
  // One model directory for both text front ends (each loads its tokenizer from it).
  flags.String("model-dir", &c->model_dir,
               "model directory whose tokenizer.json / chat template / config.json the router "
               "reads for text in and out: the OpenAI HTTP API (needed with --http-listen) and "
               "vllm.grpc.engine.VllmEngine text input and GetModelInfo (empty: token ids only)");
}

}  // namespace

int RunRouterCommand(const std::vector<std::string>& args) {
  RouterServerConfig config;
  config.serve.listen = serving::LoopbackAddress(7000);
  config.serve.metrics_listen = "127.0.0.1:9100";
  FlagSet flags("fluxion router",
                "Serves fluxion.v1.DecodeService and forwards each request to a prefill/decode "
                "pair picked by load, with health checks, retries before the first token and load "
                "shedding (docs/CLUSTER.md).");
  serving::RegisterServeFlags(
      flags, "gRPC address to serve clients on (0.0.0.0:7000: every interface)", &config.serve);
  RegisterBackendFlags(flags, &config);
  RegisterServingFlags(flags, &config);
  RegisterOpenAiFlags(flags, &config.openai);
  serving::RegisterServerTlsFlags(flags, &config.tls);
  serving::RegisterClientTlsFlags(flags, "backend-tls", "decode and prefill nodes",
                                  &config.backend_tls);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  return serving::CreateAndServe<RouterServer>(std::move(config));
}

}  // namespace fluxion::cluster
