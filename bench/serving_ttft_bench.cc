// `fluxion bench serving-ttft`: where a request's time to first token goes on a running prefill + decode
// pair. Sends --requests greedy requests of --prompt_tokens random byte tokens, one at a time,
// with max_tokens 1, and prints the medians of the decode node's GenerateTiming split: admission
// (queue_us), prefill compute, transfer (total and the tail not hidden behind compute), the
// decode node's load (checksums, sparse state, policy setup) and TTFT. A measurement tool, not a
// test; bench/measure_ttft.sh drives it and bench/results/ records its output.
//
// With --cancel_after_ms, it measures cancellation instead: each request is cancelled by the
// client that long after it was sent, and the time from the cancel to every KV page being free
// again (polled through GetLoad every 1 ms) is reported as p50/p99/max.
#include "bench/serving_ttft_bench.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/flag_set.h"
#include "common/grpc_security.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace {

namespace v1 = ::fluxion::v1;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(const std::vector<std::string>& args) {
  std::string address = "127.0.0.1:7002", policy, label;
  int64_t prompt_tokens = 1024, requests = 5, vocab = 256, cancel_after_ms = -1;
  bool verbose = false;
  fluxion::FlagSet flags("fluxion bench serving-ttft", "Median TTFT split of a prefill + decode pair.");
  flags.String("decode", &address, "decode node address");
  flags.Int("prompt_tokens", &prompt_tokens, "prompt length");
  flags.Int("requests", &requests, "requests (sequential); the first is a warm-up, not counted");
  flags.Int("vocab", &vocab, "prompt ids are drawn from [0, vocab)");
  flags.String("policy", &policy, "sparse policy; empty = the node's default");
  flags.String("label", &label, "a label printed in the result line");
  flags.Int("cancel_after_ms", &cancel_after_ms,
            "measure cancellation: cancel each request this long after sending it (-1: off)");
  flags.Bool("verbose", &verbose, "print every cancellation with the phase it hit");
  fluxion::serving::ClientTlsOptions tls;
  fluxion::serving::RegisterClientTlsFlags(flags, "tls", "the decode node", &tls);
  if (int rc = fluxion::ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  auto channel = fluxion::serving::ClientChannelConfig(tls);
  if (!channel.ok()) {
    std::cerr << "error: " << channel.status().message() << "\n";
    return 2;
  }

  auto stub = v1::DecodeService::NewStub(fluxion::serving::CreateChannel(address, *channel));
  std::mt19937 rng(7);
  std::vector<double> queue, compute, state, transfer, tail, load, prefill, ttft, release;
  auto all_free = [&] {
    grpc::ClientContext c;
    c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::DecodeLoad load;
    return stub->GetLoad(&c, v1::GetLoadRequest(), &load).ok() &&
           load.free_kv_pages() == load.total_kv_pages();
  };
  for (int64_t i = 0; i <= requests; ++i) {
    v1::GenerateRequest r;
    r.set_request_id("probe-" + std::to_string(i) + "-" + std::to_string(absl::ToUnixNanos(absl::Now())));
    for (int64_t t = 0; t < prompt_tokens; ++t) r.add_prompt_token_ids(rng() % vocab);
    r.mutable_sampling()->set_temperature(0);
    r.mutable_sampling()->set_max_tokens(1);
    if (!policy.empty()) r.mutable_sparse()->set_policy(policy);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
    if (cancel_after_ms >= 0) r.mutable_sampling()->set_max_tokens(1 << 20);
    auto reader = stub->Generate(&context, r);
    if (cancel_after_ms >= 0) {
      absl::SleepFor(absl::Milliseconds(cancel_after_ms));
      v1::DecodeLoad before;
      if (verbose) {
        grpc::ClientContext c;
        (void)stub->GetLoad(&c, v1::GetLoadRequest(), &before);
      }
      const absl::Time cancelled = absl::Now();
      context.TryCancel();
      while (!all_free() && absl::Now() - cancelled < absl::Seconds(10)) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      release.push_back(absl::ToDoubleMilliseconds(absl::Now() - cancelled));
      if (verbose) {
        std::printf("# cancel %lld: %s, pages free after %.1f ms\n", static_cast<long long>(i),
                    before.prefilling_requests() > 0 ? "during prefill"
                    : before.running_requests() > 0  ? "during decode"
                                                     : "queued or other",
                    release.back());
      }
      v1::GenerateResponse ignored;
      while (reader->Read(&ignored)) {
      }
      (void)reader->Finish();
      continue;
    }
    v1::GenerateResponse msg;
    v1::GenerateTiming timing;
    while (reader->Read(&msg)) {
      if (msg.has_complete()) timing = msg.complete().timing();
    }
    grpc::Status s = reader->Finish();
    if (!s.ok()) {
      std::fprintf(stderr, "request %lld: %s\n", static_cast<long long>(i), s.error_message().c_str());
      return 1;
    }
    if (i == 0) continue;  // warm-up
    queue.push_back(timing.queue_us() / 1e3);
    compute.push_back(timing.prefill_compute_us() / 1e3);
    state.push_back(timing.sparse_state_us() / 1e3);
    transfer.push_back(timing.transfer_us() / 1e3);
    tail.push_back(timing.transfer_tail_us() / 1e3);
    load.push_back(timing.load_us() / 1e3);
    prefill.push_back(timing.prefill_us() / 1e3);
    ttft.push_back(timing.ttft_us() / 1e3);
  }
  if (cancel_after_ms >= 0) {
    std::sort(release.begin(), release.end());
    const size_t p99 = std::min(release.size() - 1, static_cast<size_t>(release.size() * 0.99));
    std::printf("%-28s prompt %lld, cancel after %lld ms: pages free again after p50 %.1f ms, "
                "p99 %.1f ms, max %.1f ms (%zu requests)\n",
                label.c_str(), static_cast<long long>(prompt_tokens),
                static_cast<long long>(cancel_after_ms), Median(release), release[p99],
                release.back(), release.size());
    return 0;
  }
  std::printf("%-28s %7lld %9.2f %11.2f %9.2f %11.2f %10.2f %9.2f %10.2f %9.2f %7.1f%%\n",
              label.c_str(), static_cast<long long>(prompt_tokens), Median(queue), Median(compute),
              Median(state),
              Median(transfer), Median(tail), Median(load), Median(prefill), Median(ttft),
              100.0 * Median(tail) / std::max(1e-9, Median(ttft)));
  return 0;
}

}  // namespace

namespace fluxion::bench {

int RunServingTtftBench(const std::vector<std::string>& args) { return ::Main(args); }

}  // namespace fluxion::bench
