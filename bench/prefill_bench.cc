#include "bench/prefill_bench.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "decode/kv/kv_admission.h"
#include "decode/kv/kv_arena.h"
#include "decode/serving/generate_call_steps.h"
#include "decode/sparse/policy.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/cuda_dense_ops.h"
#include "model/model.h"
#include "model/random_model.h"
#include "model/random_params.h"
#include "prefill/device_prefill.h"
#include "prefill/prefill_engine.h"
#include "proto/convert.h"
#include "transfer/kv_pages.h"
#include "transfer/page_meta.h"
#include "transfer/ucx_flags.h"
#include "transfer/ucx_transport.h"

namespace fluxion::bench {
namespace {

namespace v1 = ::fluxion::v1;
using Clock = std::chrono::steady_clock;

// Length-prefixed messages over a pipe between the two processes.
bool WriteMessage(int fd, const std::string& m) {
  const uint64_t n = m.size();
  std::string all(reinterpret_cast<const char*>(&n), sizeof(n));
  all += m;
  const char* p = all.data();
  size_t left = all.size();
  while (left > 0) {
    const ssize_t k = write(fd, p, left);
    if (k <= 0) return false;
    p += k;
    left -= static_cast<size_t>(k);
  }
  return true;
}

bool ReadExact(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = read(fd, p, n);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

absl::StatusOr<std::string> ReadMessage(int fd) {
  uint64_t n = 0;
  if (!ReadExact(fd, reinterpret_cast<char*>(&n), sizeof(n)) || n > (uint64_t{1} << 32)) {
    return absl::UnavailableError("the other bench process went away");
  }
  std::string m(n, '\0');
  if (!ReadExact(fd, m.data(), n))
    return absl::UnavailableError("the other bench process went away");
  return m;
}

struct Options {
  std::string device = "cuda", preset = "llama3.1-8b", model_dir, json, policy = "lfps";
  std::vector<int64_t> contexts = {8192, 32768};
  std::vector<int64_t> batches = {1};
  std::vector<std::string> send = {"layerwise", "after"};
  int64_t page_tokens = 16, chunk_tokens = prefill::DevicePrefillOptions{}.chunk_tokens;
  int64_t repeats = 1;
  int64_t staging_ring_mib =
      static_cast<int64_t>(prefill::PrefillEngineOptions{}.staging_ring_bytes >> 20);
  transfer::UcxFlags ucx;
};

// The engine's options for one `send` mode. "after" stages the whole prompt, as the node did
// before the ring: the baseline sends everything at once after the last layer.
prefill::PrefillEngineOptions EngineOptions(const Options& o, const std::string& send) {
  prefill::PrefillEngineOptions eo;
  eo.layerwise = send == "layerwise";
  eo.transfer_timeout = absl::Seconds(120);
  eo.staging_ring_bytes = eo.layerwise ? static_cast<uint64_t>(o.staging_ring_mib) << 20
                                       : std::numeric_limits<uint64_t>::max();
  return eo;
}

// The decode side of one prompt: reserve, describe, land. Runs in the child.
class DecodeSide {
 public:
  DecodeSide(const Options& o, const model::ModelConfig& c, const v1::ModelLayout& layout)
      : o_(o), c_(c), layout_(layout) {}

  // An arena for the largest point: b prompts of n tokens, each with its side room.
  absl::Status Init() {
    FLUXION_ASSIGN_OR_RETURN(transport_, transfer::NewUcxTransport(o_.ucx.ToOptions(
                                             "bench-decode", proto::CompatibilityOf(layout_, 1))));
    const decode::KvShape shape{c_.num_layers, c_.num_kv_heads, c_.head_dim, o_.page_tokens};
    const transfer::KvPageGeometry geo{c_.num_layers, c_.num_kv_heads, c_.head_dim, o_.page_tokens};
    int64_t pages = 0;
    for (int64_t n : o_.contexts) {
      const int64_t state_pages =
          static_cast<int64_t>(decode::SparseStateBytes(c_.num_layers, c_.num_kv_heads, n) /
                               shape.page_bytes()) +
          2;
      const int64_t meta_pages =
          decode::PageMetaRoomPages(Shape(), o_.page_tokens, n, shape.page_bytes());
      for (int64_t b : o_.batches) {
        pages = std::max(pages, b * (geo.total_pages(n) + meta_pages + state_pages));
      }
    }
    FLUXION_ASSIGN_OR_RETURN(arena_, decode::KvArena::Create(shape.page_bytes(), pages));
    FLUXION_ASSIGN_OR_RETURN(registration_,
                             transport_->Register({arena_->base(), arena_->bytes()}, {true}));
    FLUXION_ASSIGN_OR_RETURN(descriptor_, registration_->Describe());
    admission_ = std::make_unique<decode::KvAdmission>(arena_.get(), decode::KvAdmissionOptions{});
    FLUXION_ASSIGN_OR_RETURN(policy_, decode::sparse::ParsePolicy(o_.policy, 0.05));
    return absl::OkStatus();
  }

  // Serves batches until the parent closes the pipe: each ask is "n b", b prompts of n tokens.
  void Serve(int in, int out) {
    for (;;) {
      absl::StatusOr<std::string> ask = ReadMessage(in);
      if (!ask.ok()) return;
      long long n = 0, b = 0;
      if (std::sscanf(ask->c_str(), "%lld %lld", &n, &b) != 2 || n < 1 || b < 1) return;
      absl::StatusOr<std::string> reply = OneBatch(n, b, in, out);
      WriteMessage(out,
                   reply.ok() ? "ok " + *reply : "error " + std::string(reply.status().message()));
    }
  }

 private:
  // One prompt's room here, reserved and described to the prefill side.
  struct Pending {
    decode::Reservation kv, room;
    int64_t meta_pages = 0;
  };

  // Reserves room for `b` prompts of `n` tokens and sends their requests, reads the b answers,
  // lands each: "reserve_s land_s", both summed over the batch.
  absl::StatusOr<std::string> OneBatch(int64_t n, int64_t b, int in, int out) {
    const Clock::time_point t0 = Clock::now();
    std::vector<Pending> pending(b);
    std::vector<v1::PrefillRequest> requests(b);
    for (int64_t i = 0; i < b; ++i) {
      FLUXION_ASSIGN_OR_RETURN(requests[i], Reserve(n, i, &pending[i]));
    }
    const double reserve_s = std::chrono::duration<double>(Clock::now() - t0).count();
    for (const v1::PrefillRequest& r : requests) {
      if (!WriteMessage(out, r.SerializeAsString())) return absl::UnavailableError("parent gone");
    }
    std::vector<std::string> answers(b);
    for (std::string& a : answers) {
      FLUXION_ASSIGN_OR_RETURN(a, ReadMessage(in));
    }
    for (Pending& p : pending) {
      p.kv.SetPeerStopped();
      if (!p.room.empty()) p.room.SetPeerStopped();
    }
    const Clock::time_point t1 = Clock::now();
    for (int64_t i = 0; i < b; ++i) FLUXION_RETURN_IF_ERROR(Land(n, answers[i], pending[i]));
    const double land_s = std::chrono::duration<double>(Clock::now() - t1).count();
    return absl::StrFormat("%.6f %.6f", reserve_s, land_s);
  }

  absl::StatusOr<v1::PrefillRequest> Reserve(int64_t n, int64_t index, Pending* p) {
    const transfer::KvPageGeometry geo{c_.num_layers, c_.num_kv_heads, c_.head_dim, o_.page_tokens};
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    FLUXION_ASSIGN_OR_RETURN(
        p->kv, admission_->Reserve(geo.total_pages(n), deadline, [] { return false; }));
    // The side room as the decode node reserves it: page metadata, then the sparse state.
    const model::AttentionShape shape = Shape();
    p->meta_pages = decode::PageMetaRoomPages(shape, o_.page_tokens, n, arena_->page_bytes());
    int64_t state_pages = 0;
    if (NeedsState()) {
      const uint64_t bytes = decode::SparseStateBytes(c_.num_layers, c_.num_kv_heads, n);
      state_pages = static_cast<int64_t>((bytes + arena_->page_bytes() - 1) / arena_->page_bytes());
    }
    if (p->meta_pages + state_pages > 0) {
      FLUXION_ASSIGN_OR_RETURN(p->room, admission_->Reserve(p->meta_pages + state_pages, deadline,
                                                            [] { return false; }));
      FLUXION_RETURN_IF_ERROR(p->room.RegisterRuns(transport_.get()));
    }
    FLUXION_RETURN_IF_ERROR(p->kv.RegisterRuns(transport_.get()));
    v1::GenerateRequest generate;
    std::mt19937 rng(static_cast<uint32_t>(n + index));
    for (int64_t i = 0; i < n; ++i) {
      generate.add_prompt_token_ids(static_cast<uint32_t>(rng() % c_.vocab_size));
    }
    decode::PrefillTarget target{&descriptor_, arena_->page_bytes(),  &p->kv,   &p->room,
                                 NeedsState(), geo.pages_per_head(n), &layout_, p->meta_pages};
    model::SamplingParams sampling;
    v1::PrefillRequest request = decode::BuildPrefillRequest(absl::StrCat("bench-", n, "-", index),
                                                             generate, sampling, target);
    p->kv.SetPeerMayWrite(absl::Seconds(60));
    if (!p->room.empty()) p->room.SetPeerMayWrite(absl::Seconds(60));
    return request;
  }

  // Lands one answered prompt as the decode node does (on its CPU pool), then frees its pages.
  absl::Status Land(int64_t n, const std::string& answer, Pending& p) {
    v1::PrefillResponse landed;
    if (answer.empty() || !landed.ParseFromString(answer)) {
      return absl::AbortedError("the prefill failed (see the prefill side's error)");
    }
    decode::LandingInput input;
    input.arena = arena_.get();
    input.shape = Shape();
    input.page_tokens = o_.page_tokens;
    input.prompt_tokens = n;
    input.landed = &landed;
    input.policy = &policy_;
    input.needs_state = NeedsState();
    input.meta_pages = p.meta_pages;
    input.pool = &pool_;
    bool checksum_failed = false;
    FLUXION_ASSIGN_OR_RETURN(
        auto attention,
        decode::LandPrompt(input, std::move(p.kv), std::move(p.room), &checksum_failed));
    return absl::OkStatus();
  }

  bool NeedsState() const { return decode::sparse::TraitsOf(policy_.kind).needs_sparse_state; }

  model::AttentionShape Shape() const {
    return model::AttentionShape{c_.num_layers, c_.num_heads, c_.num_kv_heads, c_.head_dim,
                                 1.0f / std::sqrt(static_cast<float>(c_.head_dim))};
  }

  const Options& o_;
  const model::ModelConfig c_;
  const kernels::cpu::CpuPool pool_{static_cast<int>(std::thread::hardware_concurrency())};
  const v1::ModelLayout layout_;
  std::unique_ptr<transfer::UcxTransport> transport_;
  std::unique_ptr<decode::KvArena> arena_;
  std::unique_ptr<transfer::Registration> registration_;
  transfer::PeerDescriptor descriptor_;
  std::unique_ptr<decode::KvAdmission> admission_;
  decode::sparse::PolicyConfig policy_;
};

struct Row {
  int64_t context = 0;
  std::string send;
  double ttft_ms = 0, compute_ms = 0, state_ms = 0, tail_ms = 0, reserve_ms = 0, land_ms = 0;
  // The engine's own span (arrival to reply, PrefillTiming.total_us): TTFT minus it, reserve and
  // land is what the call costs outside the engine; it minus compute, state and tail is the
  // engine's setup (validation, connection, staging) and its wait for the last pieces.
  double engine_ms = 0;
  double kv_gb = 0, transfer_gbps = 0, prefill_tok_s = 0;
};

absl::StatusOr<model::ModelConfig> ConfigOf(const Options& o) {
  if (!o.model_dir.empty()) return model::LoadModelConfig(o.model_dir + "/config.json");
  return model::PresetConfig(o.preset);
}

int Fail(const absl::Status& s) {
  std::cerr << "error: " << s << "\n";
  return 1;
}

// One point's run: the decode side reserves `b` prompts of `n` tokens and sends their requests,
// the engine prefills them as one batch, the decode side lands them. TTFT is the batch's: its
// reservations, the batch's prefill until the last reply, and its landings; compute, state and
// tail are the slowest request's; prefill tokens/s counts the whole batch.
absl::StatusOr<Row> OneBatch(const prefill::PrefillEngine& engine, int64_t n, int64_t b,
                             const std::string& send, int in, int out) {
  WriteMessage(out, absl::StrCat(n, " ", b));
  std::vector<v1::PrefillRequest> requests(b);
  for (v1::PrefillRequest& request : requests) {
    absl::StatusOr<std::string> bytes = ReadMessage(in);
    if (!bytes.ok() || !request.ParseFromString(*bytes)) {
      return absl::InternalError(
          absl::StrCat("decode side: ", bytes.ok() ? *bytes : bytes.status().ToString()));
    }
  }
  std::vector<const v1::PrefillRequest*> pointers;
  std::vector<std::function<bool()>> cancelled(b, [] { return false; });
  for (const v1::PrefillRequest& r : requests) pointers.push_back(&r);
  std::vector<absl::StatusOr<v1::PrefillResponse>> replies(b, absl::UnknownError("no reply"));
  const Clock::time_point t0 = Clock::now();
  engine.RunBatch(pointers, cancelled, [&](size_t i, absl::StatusOr<v1::PrefillResponse> r) {
    replies[i] = std::move(r);
  });
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (const auto& r : replies) WriteMessage(out, r.ok() ? r->SerializeAsString() : std::string());
  absl::StatusOr<std::string> landed = ReadMessage(in);
  for (const auto& r : replies) {
    if (!r.ok()) return r.status();
  }
  if (!landed.ok() || landed->rfind("ok ", 0) != 0) {
    return absl::InternalError(
        absl::StrCat("landing: ", landed.ok() ? *landed : landed.status().ToString()));
  }
  double reserve_s = 0, land_s = 0;
  std::sscanf(landed->c_str() + 3, "%lf %lf", &reserve_s, &land_s);
  Row row;
  row.context = n;
  row.send = send;
  uint64_t kv_bytes = 0, transfer_us = 0, compute_us = 0;
  for (const auto& r : replies) {
    const v1::PrefillTiming& t = r->timing();
    row.compute_ms = std::max(row.compute_ms, t.compute_us() / 1e3);
    row.state_ms = std::max(row.state_ms, t.sparse_state_us() / 1e3);
    row.tail_ms = std::max(row.tail_ms, t.transfer_tail_us() / 1e3);
    row.engine_ms = std::max(row.engine_ms, t.total_us() / 1e3);
    kv_bytes += r->kv_bytes_written();
    transfer_us = std::max<uint64_t>(transfer_us, t.transfer_us());
    compute_us = std::max<uint64_t>(compute_us, t.compute_us());
  }
  row.reserve_ms = reserve_s * 1e3;
  row.land_ms = land_s * 1e3;
  row.ttft_ms = (reserve_s + prefill_s + land_s) * 1e3;
  row.kv_gb = kv_bytes / 1e9;
  // Only when everything goes after the last layer is the transfer time the transfer's own
  // (layer-wise, it spans the compute it overlaps).
  row.transfer_gbps = send == "after" && transfer_us > 0 ? kv_bytes / (transfer_us / 1e6) / 1e9 : 0;
  row.prefill_tok_s = compute_us > 0 ? static_cast<double>(b * n) / (compute_us / 1e6) : 0;
  return row;
}

void RegisterFlags(FlagSet& flags, Options& o) {
  flags.String("device", &o.device, "where the prefill computes: cuda or cpu");
  flags.String("preset", &o.preset,
               "model shape with random weights made on the GPU (--device cuda; ignored with "
               "--model)");
  flags.String("model", &o.model_dir, "model directory instead of a preset");
  flags.IntList("contexts", &o.contexts, "prompt lengths in tokens");
  flags.IntList("batch", &o.batches,
                "prompts prefilled together per point (the prefill node's batch: one forward, "
                "their rows packed into shared chunks on the GPU), each of the point's length");
  flags.StringList("send", &o.send,
                   "layerwise (each piece as it completes) and/or after (everything after the "
                   "last layer)");
  flags.Int("page-tokens", &o.page_tokens, "tokens per KV page");
  flags.Int("chunk-tokens", &o.chunk_tokens, "the GPU prefill's rows per pass through the layers");
  flags.Int("repeats", &o.repeats, "runs per point (the table shows the median)");
  flags.Int("staging-ring-mib", &o.staging_ring_mib,
            "host memory the layerwise sends pass through (the prefill node's "
            "--staging-ring-mib); 'after' stages the whole prompt");
  flags.String("policy", &o.policy,
               "the decode side's policy for landing (lfps / fluxion need the sparse state, "
               "whose capture and transfer are then timed too)");
  flags.String("json", &o.json, "write machine-readable results here");
  o.ucx.Register(flags);
}

absl::Status CheckOptions(const Options& o) {
  if (o.device != "cuda" && o.device != "cpu") {
    return absl::InvalidArgumentError("--device cuda|cpu");
  }
  if (o.device == "cpu" && o.model_dir.empty()) {
    return absl::InvalidArgumentError("--device cpu needs --model");
  }
  for (int64_t b : o.batches) {
    if (b < 1 || b > 256) return absl::InvalidArgumentError("--batch takes 1 to 256 prompts");
  }
  for (int64_t n : o.contexts) {
    if (n < 1) return absl::InvalidArgumentError("--contexts takes positive lengths");
  }
  for (const std::string& send : o.send) {
    if (send != "layerwise" && send != "after") {
      return absl::InvalidArgumentError("--send takes layerwise and/or after");
    }
  }
  return absl::OkStatus();
}

// The decode side in a child process, forked before CUDA or UCX exist in this process, spoken
// to over two pipes. Stop() (or the destructor) closes its input and waits for it.
class DecodeChild {
 public:
  static absl::StatusOr<std::unique_ptr<DecodeChild>> Start(const Options& o,
                                                            const model::ModelConfig& config,
                                                            const v1::ModelLayout& layout) {
    int to_child[2], to_parent[2];
    if (pipe(to_child) != 0 || pipe(to_parent) != 0) return absl::InternalError("pipe");
    const pid_t pid = fork();
    if (pid == 0) {
      close(to_child[1]);
      close(to_parent[0]);
      DecodeSide side(o, config, layout);
      absl::Status s = side.Init();
      WriteMessage(to_parent[1], s.ok() ? "ready" : "error " + std::string(s.message()));
      if (s.ok()) side.Serve(to_child[0], to_parent[1]);
      _exit(s.ok() ? 0 : 1);
    }
    close(to_child[0]);
    close(to_parent[1]);
    auto child = std::unique_ptr<DecodeChild>(new DecodeChild(pid, to_parent[0], to_child[1]));
    absl::StatusOr<std::string> ready = ReadMessage(child->in());
    if (!ready.ok() || *ready != "ready") {
      return absl::InternalError(
          absl::StrCat("decode side: ", ready.ok() ? *ready : ready.status().ToString()));
    }
    return child;
  }

  ~DecodeChild() { Stop(); }

  void Stop() {
    if (pid_ < 0) return;
    close(out_);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  int in() const { return in_; }    // messages from the child
  int out() const { return out_; }  // messages to the child

 private:
  DecodeChild(pid_t pid, int in, int out) : pid_(pid), in_(in), out_(out) {}
  pid_t pid_;
  int in_, out_;
};

// The prefill side's engine input: the model on the CPU, or the GPU prefill with its weights
// (the model's or random ones of --preset) and the largest staging any point uses (a slice per
// prompt) pinned once, now.
struct PrefillSide {
  std::unique_ptr<model::Model> cpu_model;
  std::unique_ptr<prefill::DevicePrefill> gpu;
  double weights_s = 0;
};

absl::StatusOr<PrefillSide> MakePrefillSide(const Options& o, const model::ModelConfig& config) {
  PrefillSide side;
  const Clock::time_point t0 = Clock::now();
  if (!o.model_dir.empty()) {
    FLUXION_ASSIGN_OR_RETURN(side.cpu_model, model::Model::Load(o.model_dir));
  }
  if (o.device == "cuda") {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::DenseOps> ops, model::NewCudaDenseOps(0));
    kernels::cpu::CpuPool pool(static_cast<int>(std::thread::hardware_concurrency()));
    FLUXION_ASSIGN_OR_RETURN(model::ModelParams params,
                             side.cpu_model != nullptr
                                 ? side.cpu_model->UploadParams(*ops)
                                 : model::RandomParams(config, *ops, 1, &pool));
    FLUXION_ASSIGN_OR_RETURN(
        side.gpu, prefill::DevicePrefill::Create(
                      config, std::move(ops), std::move(params),
                      prefill::DevicePrefillOptions{o.chunk_tokens, model::SparseStateParams{}}));
    side.cpu_model.reset();
    const transfer::KvPageGeometry geo{config.num_layers, config.num_kv_heads, config.head_dim,
                                       o.page_tokens};
    uint64_t pinned = 0;
    for (const std::string& send : o.send) {
      for (int64_t n : o.contexts) {
        for (int64_t b : o.batches) {
          pinned = std::max<uint64_t>(
              pinned, b * prefill::DeviceStagingBytes(EngineOptions(o, send), geo, n));
        }
      }
    }
    FLUXION_RETURN_IF_ERROR(side.gpu->HostStaging(pinned).status());
  }
  side.weights_s = std::chrono::duration<double>(Clock::now() - t0).count();
  return side;
}

void PrintHeader(const Options& o, const std::string& model_id, double weights_s) {
  std::printf(
      "prefill on %s (%s, weights ready in %.1f s), UCX tls '%s', pages of %lld tokens, "
      "landing policy %s\n",
      o.device.c_str(), model_id.c_str(), weights_s, o.ucx.tls.c_str(),
      static_cast<long long>(o.page_tokens), o.policy.c_str());
  std::printf("%8s %5s %-9s %10s %9s %10s %9s %9s %9s %9s %8s %9s %10s\n", "context", "batch",
              "send", "TTFT ms", "engine", "compute", "state", "tail", "reserve", "land", "KV GB",
              "xfer GB/s", "prefill t/s");
}

// Prints the point's median row and appends its JSON record.
void ReportPoint(int64_t n, int64_t b, const std::string& send, const Row& m, size_t repeats,
                 nlohmann::json* results) {
  std::printf("%8lld %5lld %-9s %10.1f %9.1f %10.1f %9.1f %9.1f %9.1f %9.1f %8.2f %9.2f %10.0f\n",
              static_cast<long long>(n), static_cast<long long>(b), send.c_str(), m.ttft_ms,
              m.engine_ms, m.compute_ms, m.state_ms, m.tail_ms, m.reserve_ms, m.land_ms, m.kv_gb,
              m.transfer_gbps, m.prefill_tok_s);
  std::fflush(stdout);
  results->push_back({{"context", n},
                      {"batch", b},
                      {"send", send},
                      {"ttft_ms", m.ttft_ms},
                      {"engine_ms", m.engine_ms},
                      {"compute_ms", m.compute_ms},
                      {"sparse_state_ms", m.state_ms},
                      {"transfer_tail_ms", m.tail_ms},
                      {"reserve_ms", m.reserve_ms},
                      {"land_ms", m.land_ms},
                      {"kv_gb", m.kv_gb},
                      {"transfer_gbps", m.transfer_gbps},
                      {"prefill_tok_s", m.prefill_tok_s},
                      {"repeats", repeats}});
}

// Every (context, batch, send) point: --repeats runs (one more, untimed, before the first
// point), the median by TTFT reported.
absl::Status RunPoints(const Options& o, const PrefillSide& side, transfer::UcxTransport* transport,
                       const v1::ModelLayout& layout, const DecodeChild& child,
                       nlohmann::json* results) {
  bool first_run = true;
  for (int64_t n : o.contexts) {
    for (int64_t b : o.batches) {
      for (const std::string& send : o.send) {
        const prefill::PrefillEngineOptions eo = EngineOptions(o, send);
        auto engine = side.gpu != nullptr ? std::make_unique<prefill::PrefillEngine>(
                                                side.gpu.get(), transport, layout, eo)
                                          : std::make_unique<prefill::PrefillEngine>(
                                                side.cpu_model.get(), transport, layout, eo);
        std::vector<Row> samples;
        for (int64_t rep = 0; rep < o.repeats + (first_run ? 1 : 0); ++rep) {
          FLUXION_ASSIGN_OR_RETURN(Row row, OneBatch(*engine, n, b, send, child.in(), child.out()));
          if (!(first_run && rep == 0)) samples.push_back(row);
        }
        first_run = false;
        std::sort(samples.begin(), samples.end(),
                  [](const Row& x, const Row& y) { return x.ttft_ms < y.ttft_ms; });
        ReportPoint(n, b, send, samples[samples.size() / 2], samples.size(), results);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

int RunPrefillBench(const std::vector<std::string>& args) {
  Options o;
  FlagSet flags("fluxion bench prefill",
                "Time to first token of the disaggregated path at prompt lengths: the prefill "
                "engine here (CPU or GPU) writing over UCX into a forked decode side's arena, "
                "which lands the prompt with the decode node's own code.");
  RegisterFlags(flags, o);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::Status s = CheckOptions(o); !s.ok()) return Fail(s);
  absl::StatusOr<model::ModelConfig> config = ConfigOf(o);
  if (!config.ok()) return Fail(config.status());
  const std::string model_id = o.model_dir.empty() ? "random:" + o.preset : o.model_dir;
  const v1::ModelLayout layout = proto::LayoutFor(*config, model_id, model_id, o.page_tokens);
  absl::StatusOr<std::unique_ptr<DecodeChild>> child = DecodeChild::Start(o, *config, layout);
  if (!child.ok()) return Fail(child.status());
  absl::StatusOr<PrefillSide> side = MakePrefillSide(o, *config);
  if (!side.ok()) return Fail(side.status());
  absl::StatusOr<std::unique_ptr<transfer::UcxTransport>> transport = transfer::NewUcxTransport(
      o.ucx.ToOptions("bench-prefill", proto::CompatibilityOf(layout, 1)));
  if (!transport.ok()) return Fail(transport.status());
  PrintHeader(o, model_id, side->weights_s);
  nlohmann::json results = nlohmann::json::array();
  if (absl::Status s = RunPoints(o, *side, transport->get(), layout, **child, &results); !s.ok()) {
    return Fail(s);
  }
  (*child)->Stop();
  if (!o.json.empty()) {
    nlohmann::json limits = {{"device", o.device},
                             {"model", model_id},
                             {"ucx_tls", o.ucx.tls},
                             {"page_tokens", o.page_tokens},
                             {"chunk_tokens", o.chunk_tokens}};
    if (absl::Status s = WriteJson(
            o.json, ResultEnvelope(JoinCommand("fluxion bench prefill", args), limits, results));
        !s.ok()) {
      return Fail(s);
    }
  }
  return 0;
}

}  // namespace fluxion::bench
