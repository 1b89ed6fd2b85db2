// `fluxion bench reservation-keys`: what per-reservation remote keys add to one request, with UCX.
// One process holds a decode-side transport (the arena, registered whole once, as `fluxion
// decode` does) and a prefill-side transport. Per iteration, as the served path does:
//   decode: reserve the request's pages, split off the sparse-state room, register each run
//           (ucp_mem_map of a sub-range + a landing token) and describe it;
//   prefill: connect once per range (descriptor checks; the endpoint's round trip only once);
//   both: drop the targets, revoke the keys (landing closed, ucp_mem_unmap), free the pages.
// and, for comparison, the one connect with the arena-wide key the old path made per request.
//   fluxion bench reservation-keys --tls=tcp|sm [--iters=200] [--kv-pages=1536] [--state-pages=96]
#include "bench/reservation_bench.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "decode/kv/kv_admission.h"
#include "decode/kv/kv_arena.h"
#include "transfer/ucx_transport.h"

namespace fluxion::decode {
namespace {

transfer::UcxOptions Options(const std::string& node, const std::string& tls) {
  transfer::UcxOptions o;
  o.node_name = node;
  if (tls == "tcp") {
    o.config = {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}};
  } else {
    o.config = {{"TLS", "sm,self"}};
    o.peer_error_handling = false;  // UCX 1.13 shared memory has none
  }
  return o;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double P90(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() * 9 / 10];
}

int Main(const std::vector<std::string>& args) {
  std::string tls = "tcp";
  int64_t iters = 200, kv_pages = 1536, state_pages = 0;
  // --tls=tcp|sm, --iters=N, --kv-pages=N (1536: 4K tokens of the tiny model),
  // --state-pages=N (sparse-state room; 0: policy full, one range per request).
  for (const std::string& a : args) {
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq), value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "--tls") {
      tls = value;
    } else if (key == "--iters") {
      iters = std::stoll(value);
    } else if (key == "--kv-pages") {
      kv_pages = std::stoll(value);
    } else if (key == "--state-pages") {
      state_pages = std::stoll(value);
    } else {
      std::fprintf(stderr, "usage: fluxion bench reservation-keys [--tls=tcp|sm] [--iters=N] "
                           "[--kv-pages=N] [--state-pages=N]\n");
      return 2;
    }
  }
  auto decode = transfer::NewUcxTransport(Options("decode", tls));
  auto prefill = transfer::NewUcxTransport(Options("prefill", tls));
  if (!decode.ok() || !prefill.ok()) {
    std::fprintf(stderr, "cannot start UCX\n");
    return 1;
  }
  auto arena = *KvArena::Create(8192, 65536, {/*huge_pages=*/true});
  auto arena_reg = *(*decode)->Register({arena->base(), arena->bytes()}, {true});
  const transfer::PeerDescriptor arena_d = *arena_reg->Describe();
  KvAdmissionOptions ao;
  ao.release_thread = false;
  KvAdmission admission(arena.get(), ao);
  (void)(*prefill)->Connect(arena_d);  // endpoint wireup, paid once per peer either way

  std::vector<double> reg_us, connect_us, revoke_us, total_us, old_us;
  for (int64_t i = 0; i < iters; ++i) {
    const absl::Time t0 = absl::Now();
    absl::StatusOr<Reservation> r =
        admission.Reserve(kv_pages + state_pages, absl::Now() + absl::Seconds(1), [] { return false; });
    if (!r.ok()) return 1;
    Reservation state = std::move(*r->SplitAfter(kv_pages));
    if (!r->RegisterRuns(decode->get()).ok() || !state.RegisterRuns(decode->get()).ok()) return 1;
    const absl::Time t1 = absl::Now();
    std::vector<std::unique_ptr<transfer::RemoteTarget>> targets;
    for (const Reservation* held : {&*r, &state}) {
      for (const transfer::PeerDescriptor& d : held->ranges()) {
        auto t = (*prefill)->Connect(d);
        if (!t.ok()) {
          std::fprintf(stderr, "connect: %s\n", std::string(t.status().message()).c_str());
          return 1;
        }
        targets.push_back(std::move(*t));
      }
    }
    const absl::Time t2 = absl::Now();
    targets.clear();
    r->SetPeerStopped();
    state.SetPeerStopped();
    r->Release();
    state.Release();
    const absl::Time t3 = absl::Now();
    auto old = (*prefill)->Connect(arena_d);
    const absl::Time t4 = absl::Now();
    if (!old.ok()) return 1;
    reg_us.push_back(absl::ToDoubleMicroseconds(t1 - t0));
    connect_us.push_back(absl::ToDoubleMicroseconds(t2 - t1));
    revoke_us.push_back(absl::ToDoubleMicroseconds(t3 - t2));
    total_us.push_back(absl::ToDoubleMicroseconds(t3 - t0));
    old_us.push_back(absl::ToDoubleMicroseconds(t4 - t3));
  }
  std::printf("tls=%s iters=%lld ranges/request=%d (kv %lld pages%s)\n", tls.c_str(),
              static_cast<long long>(iters), state_pages > 0 ? 2 : 1,
              static_cast<long long>(kv_pages), state_pages > 0 ? " + state room" : "");
  auto row = [](const char* what, const std::vector<double>& v) {
    std::printf("  %-44s median %8.1f us  p90 %8.1f us\n", what, Median(v), P90(v));
  };
  row("reserve + register runs + describe (decode)", reg_us);
  row("connect per range (prefill)", connect_us);
  row("drop targets + revoke keys + free (both)", revoke_us);
  row("new path, all of the above", total_us);
  row("old path: one connect with the arena key", old_us);
  return 0;
}

}  // namespace
}  // namespace fluxion::decode

namespace fluxion::bench {

int RunReservationBench(const std::vector<std::string>& args) { return decode::Main(args); }

}  // namespace fluxion::bench
