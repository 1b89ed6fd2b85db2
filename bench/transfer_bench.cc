// `fluxion bench transfer`: how fast KV-shaped data moves through a Transport on this machine.
//
// A forked child owns a registered target region (the decode arena); this process writes
// `--mib` MiB into it as `--page_kib` KiB pages, three ways:
//   contiguous+coalesced   pages in order to consecutive slots: CoalesceCopies makes one message
//   contiguous, no merge   the same copies with WriteOptions::coalesce = false: one per page
//   scattered              pages to a random permutation of slots: nothing merges
// and reports GB/s (best and median of --iters, each a Write + Wait), next to a plain memcpy of the
// same bytes and the UCX endpoint description (which transports UCX picked). UCX is configured by
// --tls (tcp = TCP on lo with peer error handling; sm = shared memory without; env = UCX_*
// environment as is); --protocol and --max_message_kib choose how write messages travel
// (UcxOptions::protocol, max_message_bytes).
// Not a test: a measurement tool; docs/TRANSFER.md records its output (bench/measure_kv_transfer.sh
// runs it beside ucx_perftest).
#include "bench/transfer_bench.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/flag_set.h"
#include "transfer/transport.h"
#include "transfer/ucx_transport.h"

namespace fluxion::transfer {
namespace {

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = write(fd, c, n);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return false;
    pollfd pfd = {fd, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(ms)) <= 0) continue;
    ssize_t k = read(fd, c, n);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

int64_t busy_poll_us = 2000;  // --busy_poll_us, for both processes
std::string protocol = "auto";  // --protocol, for the writer
int64_t max_message_kib = 0;    // --max_message_kib, for the writer

UcxOptions Options(const std::string& node, const std::string& tls) {
  UcxOptions o;
  o.node_name = node;
  o.busy_poll = absl::Microseconds(busy_poll_us);
  o.protocol = protocol == "eager"  ? UcxOptions::Protocol::kEager
               : protocol == "rndv" ? UcxOptions::Protocol::kRendezvous
                                    : UcxOptions::Protocol::kAuto;
  o.max_message_bytes = static_cast<size_t>(max_message_kib) << 10;
  if (tls == "tcp") {
    o.config = {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}};
  } else if (tls == "sm") {
    o.config = {{"TLS", "sm,self"}};
    o.peer_error_handling = false;  // UCX 1.13 shared memory has none
  } else {
    o.peer_error_handling = false;  // unknown transports: keep UCX free to choose shared memory
  }
  return o;
}

[[noreturn]] void RunTarget(int cmd_fd, int reply_fd, size_t bytes, const std::string& tls) {
  auto t = NewUcxTransport(Options("bench-target", tls));
  if (!t.ok()) {
    std::fprintf(stderr, "target: %s\n", t.status().ToString().c_str());
    _exit(2);
  }
  std::vector<uint8_t> memory(bytes, 0);
  auto reg = (*t)->Register({memory.data(), memory.size()});
  if (!reg.ok()) {
    std::fprintf(stderr, "target: %s\n", reg.status().ToString().c_str());
    _exit(3);
  }
  const std::string blob = SerializeDescriptor(*(*reg)->Describe());
  const uint32_t size = blob.size();
  WriteAll(reply_fd, &size, sizeof(size));
  WriteAll(reply_fd, blob.data(), size);
  char cmd;
  ReadAll(cmd_fd, &cmd, 1, absl::Minutes(10));
  const TransportMetrics m = (*t)->metrics();
  std::fprintf(stderr, "# target: %llu bytes landed, %llu write messages refused\n",
               static_cast<unsigned long long>(m.landed_bytes),
               static_cast<unsigned long long>(m.landing_refused));
  reg->reset();
  t->reset();
  _exit(0);
}

struct Result {
  double best_gbps = 0, median_gbps = 0;
  uint64_t ops = 0;
};

int64_t batches = 1;  // --batches: the copies go out as this many Write()s, back to back

Result Measure(Transport& t, const RemoteTarget& target, const std::vector<BlockCopy>& copies,
               bool coalesce, int iters, size_t bytes) {
  std::vector<double> gbps;
  const uint64_t ops_before = t.metrics().ops_issued;
  for (int i = 0; i <= iters; ++i) {  // iteration 0 warms up
    const absl::Time start = absl::Now();
    // As the prefill node sends: one batch per layer, all in flight, then wait for each.
    std::vector<std::unique_ptr<TransferHandle>> handles;
    const size_t per = (copies.size() + batches - 1) / batches;
    for (size_t first = 0; first < copies.size(); first += per) {
      auto h = t.Write(target,
                       absl::MakeConstSpan(copies).subspan(first, std::min(per, copies.size() - first)),
                       WriteOptions{coalesce});
      if (!h.ok()) {
        std::fprintf(stderr, "write failed: %s\n", h.status().ToString().c_str());
        std::exit(1);
      }
      handles.push_back(std::move(*h));
    }
    for (auto& h : handles) {
      if (absl::Status w = h->Wait(absl::Seconds(600)); !w.ok()) {
        std::fprintf(stderr, "wait failed: %s\n", w.ToString().c_str());
        std::exit(1);
      }
    }
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    if (i > 0) gbps.push_back(bytes / s / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  Result r;
  r.best_gbps = gbps.back();
  r.median_gbps = gbps[gbps.size() / 2];
  r.ops = (t.metrics().ops_issued - ops_before) / (iters + 1);
  return r;
}

int Main(const std::vector<std::string>& args) {
  int64_t mib = 64, page_kib = 8, iters = 5;
  std::string tls = "tcp";
  bool show_endpoint = true;
  bool all_modes = true;
  FlagSet flags("fluxion bench transfer", "Write KV-shaped pages into another process through UCX.");
  flags.Int("mib", &mib, "MiB written per iteration");
  flags.Int("page_kib", &page_kib, "page size in KiB (8 = 16 tokens x head_dim 128 x bf16, K+V)");
  flags.Int("iters", &iters, "timed iterations per mode (plus one warm-up)");
  flags.String("tls", &tls, "tcp (TCP on lo), sm (shared memory) or env (UCX_* as set)");
  flags.Bool("show_endpoint", &show_endpoint, "print the endpoint UCX built (ucp_ep_print_info)");
  flags.Int("busy_poll_us", &busy_poll_us, "UcxOptions::busy_poll of both transports, in us");
  flags.String("protocol", &protocol,
               "how write messages travel: auto (UCX picks by size), eager or rndv");
  flags.Int("max_message_kib", &max_message_kib,
            "split each coalesced copy into messages of at most this many KiB (0: no split)");
  flags.Int("batches", &batches,
            "submit each iteration as this many Write()s back to back (32 = one per layer of "
            "Llama-3.1-8B, as the prefill node sends)");
  flags.Bool("all_modes", &all_modes,
             "also measure without coalescing and with scattered pages (off: coalesced only)");
  if (absl::Status s = flags.Parse(args); !s.ok() || flags.help_requested()) {
    std::fprintf(stderr, "%s\n%s", s.ToString().c_str(), flags.Usage().c_str());
    return s.ok() ? 0 : 2;
  }
  const size_t bytes = static_cast<size_t>(mib) << 20;
  const size_t page = static_cast<size_t>(page_kib) << 10;
  const size_t pages = bytes / page;

  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return 1;
  const pid_t pid = fork();  // before any thread exists in this process
  if (pid == 0) RunTarget(to_child[0], from_child[1], bytes, tls);

  auto writer = NewUcxTransport(Options("bench-writer", tls));
  if (!writer.ok()) {
    std::fprintf(stderr, "writer: %s\n", writer.status().ToString().c_str());
    return 1;
  }
  std::vector<uint8_t> source(bytes);
  for (size_t i = 0; i < bytes; ++i) source[i] = static_cast<uint8_t>(i * 13);
  std::vector<uint8_t> scratch(bytes);
  auto reg = (*writer)->Register({source.data(), source.size()}, {false});
  uint32_t size = 0;
  if (!ReadAll(from_child[0], &size, sizeof(size), absl::Seconds(30))) return 1;
  std::string blob(size, '\0');
  if (!ReadAll(from_child[0], blob.data(), size, absl::Seconds(30))) return 1;
  const PeerDescriptor d = *ParseDescriptor(blob);
  auto target = (*writer)->Connect(d);
  if (!target.ok()) {
    std::fprintf(stderr, "connect: %s\n", target.status().ToString().c_str());
    return 1;
  }
  if (show_endpoint) {
    std::printf("# endpoint (--tls=%s):\n%s\n", tls.c_str(),
                (*writer)->DescribeEndpoint(**target).value_or("?").c_str());
  }

  std::vector<BlockCopy> contiguous, scattered;
  std::vector<size_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(1));
  for (size_t i = 0; i < pages; ++i) {
    contiguous.push_back({d.base_address + i * page, source.data() + i * page, page});
    scattered.push_back({d.base_address + perm[i] * page, source.data() + i * page, page});
  }

  // memcpy baseline over the same bytes (one core, this process).
  std::vector<double> memcpy_gbps;
  for (int i = 0; i <= iters; ++i) {
    const absl::Time start = absl::Now();
    std::memcpy(scratch.data(), source.data(), bytes);
    if (i > 0) memcpy_gbps.push_back(bytes / absl::ToDoubleSeconds(absl::Now() - start) / 1e9);
  }
  std::sort(memcpy_gbps.begin(), memcpy_gbps.end());

  const Result merged = Measure(**writer, **target, contiguous, true, iters, bytes);
  Result unmerged, scatter;
  if (all_modes) {
    unmerged = Measure(**writer, **target, contiguous, false, iters, bytes);
    scatter = Measure(**writer, **target, scattered, true, iters, bytes);
  }
  std::printf("%-28s %8s %10s %10s\n", "mode", "messages", "best GB/s", "median");
  std::printf("%-28s %8s %10.2f %10.2f\n", "memcpy (same process)", "-", memcpy_gbps.back(),
              memcpy_gbps[memcpy_gbps.size() / 2]);
  const auto row = [](const char* name, const Result& r) {
    std::printf("%-28s %8llu %10.2f %10.2f\n", name, static_cast<unsigned long long>(r.ops),
                r.best_gbps, r.median_gbps);
  };
  row("contiguous, coalesced", merged);
  if (all_modes) {
    row("contiguous, not coalesced", unmerged);
    row("scattered pages", scatter);
  }
  std::printf(
      "# %lld MiB as %zu pages of %lld KiB in %lld batches, --tls=%s, --protocol=%s, "
      "--max_message_kib=%lld, busy_poll %lld us, %lld iterations\n",
      static_cast<long long>(mib), pages, static_cast<long long>(page_kib),
      static_cast<long long>(batches), tls.c_str(), protocol.c_str(),
      static_cast<long long>(max_message_kib), static_cast<long long>(busy_poll_us),
      static_cast<long long>(iters));

  target->reset();
  reg->reset();
  writer->reset();
  WriteAll(to_child[1], "Q", 1);
  int status;
  waitpid(pid, &status, 0);
  return 0;
}

}  // namespace
}  // namespace fluxion::transfer

namespace fluxion::bench {

int RunTransferBench(const std::vector<std::string>& args) { return transfer::Main(args); }

}  // namespace fluxion::bench
