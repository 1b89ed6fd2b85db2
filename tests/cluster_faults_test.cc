// The multi-host fault suite (issue 17, docs/FAULTS.md): a router, two prefill and two decode
// nodes, each its own host -- a network namespace with its own eth0 and IPv4 address, joined by
// veth pairs to a bridge (tests/netns_lab.h) -- real gRPC between them and the KV over real UCX
// over TCP on eth0 (UCX_TLS=tcp, UCX_NET_DEVICES=eth0). The test process is the client, on the
// bridge.
//
// Injected: kill -9 of a prefill node mid-transfer, kill -9 of a decode node mid-stream, SIGSTOP
// of a decode node and of a prefill node (for longer than the decode nodes' quarantine), link down
// and back up, random loss (nft) and a rate limit (tc tbf), a cancel storm, overload, a rolling
// restart of one node of each kind under load, and added delay (this kernel has no tc netem: the
// host's packets pass through tests/link_delay behind iptables NFQUEUE rules; docs/FAULTS.md).
//
// Asserted after every case, on top of each case's own checks: every process still runs (no
// crash), every decode node is idle with every KV page free again (quarantined pages included)
// and counted no checksum failure, and no shaping is left. Requests with the reference prompts
// run the `full` policy greedily, so a successful one must return exactly the tokens it returned
// before any fault: a page written by a peer after it was given to another request would change
// them (the KV's CRC-32C is checked on landing, the tokens after decoding).
//
// Needs root; it FAILS (never skips) without namespaces, tc, nft or iptables. Every wait is for a
// condition (a metric, a load report) with a generous deadline, and every assertion is on
// outcomes, not timings: a request's time is bounded only to tell "ended by its budget" from
// "nothing ended it" (kNothingEndedIt). The sleeps left are the faults themselves (how long a link
// stays down). FLUXION_FAULTS_SCALE=N (default 1) multiplies the load and the stop durations for
// a longer run by hand.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cluster/child_process.h"
#include "cluster/replayer.h"
#include "common/wait_testing.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/netns_lab.h"
#include "tests/transfer_secret_testing.h"

namespace fluxion::testing {
namespace {

namespace v1 = ::fluxion::v1;
using ::fluxion::cluster::ChildProcess;
using ::testing::HasSubstr;
using ::testing::Not;

enum Host { kRouter = 0, kPrefill0 = 1, kPrefill1 = 2, kDecode0 = 3, kDecode1 = 4, kHosts = 5 };
const std::vector<std::string> kHostNames = {"router", "prefill-0", "prefill-1", "decode-0",
                                             "decode-1"};
constexpr int kMetricsPort = 9100;
constexpr int kQuarantineMs = 2000;
constexpr int kReferencePrompts = 6;
constexpr uint32_t kReferenceTokens = 12;
// A request the servers end by its budget ends within the router's grace (0.5 s) of it; one that
// outlives its budget by a minute was ended by nothing. The client's own deadline lies beyond
// this, so that such a request is seen as outliving its budget, not as a client-side error.
constexpr absl::Duration kNothingEndedIt = absl::Seconds(60);

int Scale() {
  const char* env = std::getenv("FLUXION_FAULTS_SCALE");
  int s = 1;
  return env != nullptr && absl::SimpleAtoi(env, &s) && s >= 1 ? s : 1;
}

std::string ModelDir() {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval";
}

int PortOf(int host) {
  return host == kRouter ? 7000 : (host == kPrefill0 || host == kPrefill1) ? 7001 : 7002;
}

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// GET http://ip:port/metrics (the servers' Prometheus endpoint); "" when it does not answer.
std::string ScrapeMetrics(const std::string& ip, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nConnection: close\r\n\r\n";
  std::string response;
  if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
    char buf[8192];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, n);
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// The value of the sample `series` (name with its labels as exposed, e.g.
// `fluxion_router_backends_healthy{role="decode"}`); -1 when absent.
double MetricValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ")) {
      double v = 0;
      if (absl::SimpleAtod(line, &v)) return v;
    }
  }
  return -1;
}

struct Result {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  absl::Duration elapsed;
};

// One Generate call; the stream's error message (if any) is folded into the status.
Result Generate(const std::string& address, const v1::GenerateRequest& request,
                absl::Duration deadline, std::atomic<bool>* first_token = nullptr) {
  auto stub = v1::DecodeService::NewStub(Channel(address));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  const absl::Time start = absl::Now();
  auto reader = stub->Generate(&context, request);
  Result out;
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    for (uint32_t t : msg.chunk().token_ids()) out.tokens.push_back(t);
    if (first_token != nullptr && !out.tokens.empty()) first_token->store(true);
  }
  out.status = reader->Finish();
  out.elapsed = absl::Now() - start;
  return out;
}

std::vector<uint32_t> ReferencePrompt(int k) {
  std::vector<uint32_t> p;
  const int n = 96 + 24 * k;
  for (int i = 0; i < n; ++i) p.push_back(32 + static_cast<uint32_t>((i * (7 + k) + k) % 90));
  return p;
}

v1::GenerateRequest Request(const std::string& id, const std::vector<uint32_t>& prompt,
                            uint32_t max_tokens, absl::Duration budget) {
  v1::GenerateRequest r;
  r.set_request_id(id);
  for (uint32_t t : prompt) r.add_prompt_token_ids(t);
  r.mutable_sampling()->set_temperature(0);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  r.mutable_sparse()->set_policy("full");
  r.set_timeout_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(budget)));
  return r;
}

class ClusterFaultsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto lab = NetnsLab::Create(kHostNames);
    if (!lab.ok()) {
      *setup_error_ = std::string(lab.status().message());
      return;
    }
    lab_ = lab->release();
    char tmpl[] = "/tmp/fluxion-faults-XXXXXX";
    dir_ = new std::string(mkdtemp(tmpl));
    procs_ = new std::vector<std::unique_ptr<ChildProcess>>(kHosts);
    // Prefill nodes first (decode nodes connect to them), then decode nodes, then the router.
    for (int h : {kPrefill0, kPrefill1, kDecode0, kDecode1, kRouter}) {
      if (absl::Status s = StartHost(h); !s.ok()) {
        *setup_error_ = std::string(s.message());
        return;
      }
    }
    if (absl::Status s = WaitHealthy(2, 2, absl::Seconds(60)); !s.ok()) {
      *setup_error_ = std::string(s.message());
      return;
    }
    // The reference answers, before any fault: each prompt through the router, twice (the two
    // answers must agree; which decode node served each does not matter: `full` is exact).
    reference_ = new std::vector<std::vector<uint32_t>>();
    for (int k = 0; k < kReferencePrompts; ++k) {
      std::vector<uint32_t> first;
      for (int rep = 0; rep < 2; ++rep) {
        Result r = Generate(Address(kRouter),
                            Request(absl::StrCat("ref-", k, "-", rep), ReferencePrompt(k),
                                    kReferenceTokens, absl::Seconds(60)),
                            absl::Seconds(60));
        if (!r.status.ok() || r.tokens.size() != kReferenceTokens ||
            (rep == 1 && r.tokens != first)) {
          *setup_error_ = absl::StrCat("reference request ", k,
                                       " failed or disagreed: ", r.status.error_message());
          return;
        }
        first = r.tokens;
      }
      reference_->push_back(first);
    }
  }

  static void TearDownTestSuite() {
    if (procs_ != nullptr) {
      // Router first, then decode nodes, then prefill nodes; each must exit by itself on SIGTERM.
      for (int h : {kRouter, kDecode0, kDecode1, kPrefill0, kPrefill1}) {
        if ((*procs_)[h] == nullptr) continue;
        std::string how = (*procs_)[h]->Stop(kGenerousWait);
        EXPECT_FALSE(absl::StrContains(how, "killed")) << kHostNames[h] << ": " << how;
        EXPECT_FALSE(absl::StrContains(how, "signal")) << kHostNames[h] << ": " << how;
      }
    }
    delete procs_;
    procs_ = nullptr;
    delete lab_;  // namespaces, veths, bridge
    lab_ = nullptr;
    delete reference_;
    reference_ = nullptr;
    if (dir_ != nullptr) std::cerr << "fault suite logs: " << *dir_ << "\n";
    delete dir_;
    dir_ = nullptr;
  }

  void SetUp() override {
    ASSERT_TRUE(setup_error_->empty()) << *setup_error_ << (dir_ ? " (logs in " + *dir_ + ")" : "");
    for (int h = 0; h < kHosts; ++h) {
      ASSERT_TRUE((*procs_)[h]->Running())
          << kHostNames[h] << " is not running: " << (*procs_)[h]->LogTail();
    }
    ASSERT_TRUE(WaitHealthy(2, 2, absl::Seconds(60)).ok()) << "logs in " << *dir_;
  }

  // The invariants every case must leave behind.
  void TearDown() override {
    if (!setup_error_->empty()) return;
    for (int h = 0; h < kHosts; ++h) {
      EXPECT_TRUE(lab_->ClearShaping(h).ok()) << kHostNames[h];
      EXPECT_TRUE(lab_->LinkUp(h).ok()) << kHostNames[h];
      EXPECT_TRUE((*procs_)[h]->Running())
          << kHostNames[h] << " crashed: " << (*procs_)[h]->LogTail();
    }
    for (int h : {kDecode0, kDecode1}) {
      if (!(*procs_)[h]->Running()) continue;
      v1::DecodeLoad load = WaitIdle(h, absl::Milliseconds(kQuarantineMs) + kGenerousWait);
      EXPECT_EQ(load.free_kv_pages(), load.total_kv_pages())
          << kHostNames[h] << ": pages leaked (running " << load.running_requests()
          << ", prefilling " << load.prefilling_requests() << ", waiting "
          << load.waiting_requests() << ")";
      EXPECT_GT(load.total_kv_pages(), 0u) << kHostNames[h] << " did not answer GetLoad";
      const std::string m = ScrapeMetrics(lab_->ip(h), kMetricsPort);
      EXPECT_LE(MetricValue(m, "fluxion_transfer_failures_total{cause=\"checksum\"}"), 0)
          << kHostNames[h] << ": KV landed with a wrong checksum";
      EXPECT_EQ(MetricValue(m, "fluxion_kv_pages_quarantined"), 0) << kHostNames[h];
    }
    for (int h : {kPrefill0, kPrefill1}) {
      if (!(*procs_)[h]->Running()) continue;
      v1::PrefillLoad load = PrefillLoad(h);
      EXPECT_EQ(load.running_requests(), 0u) << kHostNames[h];
      EXPECT_EQ(load.queued_requests(), 0u) << kHostNames[h];
    }
  }

  static std::string Address(int host) { return absl::StrCat(lab_->ip(host), ":", PortOf(host)); }

  static std::vector<std::string> HostArgs(int h) {
    const std::string ip = lab_->ip(h);
    const std::string port_file = absl::StrCat(*dir_, "/", kHostNames[h], ".port");
    std::vector<std::string> args = {"--listen",         Address(h),
                                     "--port-file",      port_file,
                                     "--metrics-listen", absl::StrCat(ip, ":", kMetricsPort)};
    const std::vector<std::string> node = {"--model",   ModelDir(), "--cpu-threads",     "1",
                                           "--ucx-tls", "tcp",      "--ucx-net-devices", "eth0"};
    if (h == kPrefill0 || h == kPrefill1) {
      args.insert(args.end(), node.begin(), node.end());
      // A prompt's KV takes a while to send (25 ms after each of the 6 layers), so "mid-transfer"
      // is a window the test can hit by watching the node's load, not a race.
      args.insert(args.end(), {"--test-layer-delay-ms", "25"});
    } else if (h == kDecode0 || h == kDecode1) {
      args.insert(args.end(), node.begin(), node.end());
      const std::string own = h == kDecode0 ? Address(kPrefill0) : Address(kPrefill1);
      const std::string other = h == kDecode0 ? Address(kPrefill1) : Address(kPrefill0);
      args.insert(args.end(),
                  {"--kv-pages", "6144", "--prefill-address", own + "," + other, "--quarantine-ms",
                   std::to_string(kQuarantineMs), "--abort-wait-ms", "1000"});
    } else {
      args.insert(args.end(), {"--decode", Address(kDecode0) + "," + Address(kDecode1), "--prefill",
                               Address(kPrefill0) + "," + Address(kPrefill1), "--poll-ms", "100"});
    }
    return args;
  }

  // Starts (or restarts) host h's process and waits until it serves.
  static absl::Status StartHost(int h) {
    const std::string command = h == kRouter                         ? "router"
                                : (h == kPrefill0 || h == kPrefill1) ? "prefill"
                                                                     : "decode";
    const std::string port_file = absl::StrCat(*dir_, "/", kHostNames[h], ".port");
    unlink(port_file.c_str());
    std::vector<std::string> argv = {FLUXION_BINARY, command};
    for (std::string& a : TransferSecretArgs(command)) argv.push_back(std::move(a));
    for (std::string& a : HostArgs(h)) argv.push_back(std::move(a));
    auto child = ChildProcess::Start(kHostNames[h], lab_->InHost(h, argv),
                                     absl::StrCat(*dir_, "/", kHostNames[h], ".log"));
    if (!child.ok()) return child.status();
    (*procs_)[h] = std::move(*child);
    return (*procs_)[h]->WaitForPortFile(port_file, absl::Seconds(90)).status();
  }

  // Until the router counts `decode` and `prefill` healthy backends (its own metrics).
  static absl::Status WaitHealthy(int decode, int prefill, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    double d = -1, p = -1;
    while (absl::Now() < deadline) {
      const std::string m = ScrapeMetrics(lab_->ip(kRouter), kMetricsPort);
      d = MetricValue(m, "fluxion_router_backends_healthy{role=\"decode\"}");
      p = MetricValue(m, "fluxion_router_backends_healthy{role=\"prefill\"}");
      if (d == decode && p == prefill) return absl::OkStatus();
      absl::SleepFor(absl::Milliseconds(50));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("router sees ", d, " decode and ", p, " prefill nodes healthy, want ", decode,
                     " and ", prefill, " within ", absl::FormatDuration(timeout)));
  }

  static v1::DecodeLoad DecodeLoad(int h) {
    auto stub = v1::DecodeService::NewStub(Channel(Address(h)));
    grpc::ClientContext c;
    c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::DecodeLoad load;
    (void)stub->GetLoad(&c, v1::GetLoadRequest(), &load);
    return load;
  }

  static v1::PrefillLoad PrefillLoad(int h) {
    auto stub = v1::PrefillService::NewStub(Channel(Address(h)));
    grpc::ClientContext c;
    c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::PrefillLoad load;
    (void)stub->GetLoad(&c, v1::GetLoadRequest(), &load);
    return load;
  }

  static v1::DecodeLoad WaitIdle(int h, absl::Duration timeout) {
    return WaitForValue(
        [h] { return DecodeLoad(h); },
        [](const v1::DecodeLoad& load) {
          return load.total_kv_pages() > 0 && load.free_kv_pages() == load.total_kv_pages() &&
                 load.running_requests() == 0 && load.prefilling_requests() == 0 &&
                 load.waiting_requests() == 0;
        },
        timeout, absl::Milliseconds(50));
  }

  // Whether the router answers any request now (its own gauge).
  static double RouterInflight() {
    return Metric(kRouter, "fluxion_router_requests_inflight");
  }
  // Requests the router has finished with OK so far.
  static double RouterOk() {
    return std::max(0.0, Metric(kRouter, "fluxion_router_requests_total{code=\"OK\"}"));
  }

  static double Metric(int h, const std::string& series) {
    return MetricValue(ScrapeMetrics(lab_->ip(h), kMetricsPort), series);
  }

  // Reservations both decode nodes held for the quarantine lease (every reason: no reply, an
  // unanswered Abort, the peer's own deadline), so far.
  static double QuarantinedReservations() {
    double sum = 0;
    for (int h : {kDecode0, kDecode1}) {
      const std::string m = ScrapeMetrics(lab_->ip(h), kMetricsPort);
      for (const char* reason : {"no_reply", "abort_unanswered", "peer_gave_up"}) {
        sum += std::max(
            0.0, MetricValue(m, absl::StrCat("fluxion_kv_quarantined_reservations_total{reason=\"",
                                             reason, "\"}")));
      }
    }
    return sum;
  }

  // The decode node (kDecode0/kDecode1) holding a request now, or -1.
  static int BusyDecodeNode() {
    for (int h : {kDecode0, kDecode1}) {
      v1::DecodeLoad l = DecodeLoad(h);
      if (l.running_requests() > 0 || l.prefilling_requests() > 0) return h;
    }
    return -1;
  }

  // `n` reference requests (prompt k = i % kReferencePrompts) at once through `address`; each must
  // end OK with exactly the reference tokens, or (allow_errors) with a clear error, within its
  // budget plus the router's grace.
  struct Burst {
    std::vector<std::thread> threads;
    std::vector<Result> results;
    std::vector<int> prompt;
  };
  static std::unique_ptr<Burst> StartBurst(const std::string& tag, int n, absl::Duration budget,
                                           const std::string& prefill_address = "") {
    auto b = std::make_unique<Burst>();
    b->results.resize(n);
    b->prompt.resize(n);
    for (int i = 0; i < n; ++i) {
      b->prompt[i] = i % kReferencePrompts;
      b->threads.emplace_back([&, i, tag, budget, prefill_address, raw = b.get()] {
        v1::GenerateRequest r = Request(absl::StrCat(tag, "-", i), ReferencePrompt(raw->prompt[i]),
                                        kReferenceTokens, budget);
        if (!prefill_address.empty()) r.set_prefill_address(prefill_address);
        raw->results[i] = Generate(Address(kRouter), r, budget + 2 * kNothingEndedIt);
      });
    }
    return b;
  }
  static int JoinBurst(Burst& b, absl::Duration budget, bool allow_errors) {
    for (auto& t : b.threads) t.join();
    int ok = 0;
    for (size_t i = 0; i < b.results.size(); ++i) {
      const Result& r = b.results[i];
      EXPECT_LT(r.elapsed, budget + kNothingEndedIt) << "request " << i << " outlived its budget";
      if (r.status.ok()) {
        ++ok;
        EXPECT_EQ(r.tokens, (*reference_)[b.prompt[i]])
            << "request " << i << " (prompt " << b.prompt[i] << ") returned other tokens";
      } else {
        EXPECT_TRUE(allow_errors) << "request " << i << ": " << r.status.error_code() << " "
                                  << r.status.error_message();
        EXPECT_FALSE(r.status.error_message().empty())
            << "request " << i << ": error without "
            << "a message, code " << r.status.error_code();
      }
    }
    return ok;
  }
  static int RunBurst(const std::string& tag, int n, bool allow_errors = false,
                      absl::Duration budget = absl::Seconds(60),
                      const std::string& prefill_address = "") {
    auto b = StartBurst(tag, n, budget, prefill_address);
    return JoinBurst(*b, budget, allow_errors);
  }

  static std::string* setup_error_;
  static NetnsLab* lab_;
  static std::string* dir_;
  static std::vector<std::unique_ptr<ChildProcess>>* procs_;
  static std::vector<std::vector<uint32_t>>* reference_;
};
std::string* ClusterFaultsTest::setup_error_ = new std::string();
NetnsLab* ClusterFaultsTest::lab_ = nullptr;
std::string* ClusterFaultsTest::dir_ = nullptr;
std::vector<std::unique_ptr<ChildProcess>>* ClusterFaultsTest::procs_ = nullptr;
std::vector<std::vector<uint32_t>>* ClusterFaultsTest::reference_ = nullptr;

// The hosts are separate: each node listens on its own namespace's eth0 address, and UCX sends
// the KV over TCP between namespaces (bytes sent by a prefill node, received by a decode node).
TEST_F(ClusterFaultsTest, NodesAreSeparateHostsAndKvCrossesTheBridgeOverUcx) {
  EXPECT_EQ(RunBurst("hosts", 4), 4);
  double sent = 0, received = 0;
  for (int h : {kPrefill0, kPrefill1}) {
    sent += std::max(0.0, Metric(h, "fluxion_transfer_bytes_total{direction=\"sent\"}"));
  }
  for (int h : {kDecode0, kDecode1}) {
    received += std::max(0.0, Metric(h, "fluxion_transfer_bytes_total{direction=\"received\"}"));
  }
  EXPECT_GT(sent, 0);
  EXPECT_GT(received, 0);
  // Nothing listens on the test's own loopback: the addresses are the namespaces'.
  EXPECT_EQ(ScrapeMetrics("127.0.0.1", kMetricsPort), "");
}

TEST_F(ClusterFaultsTest, PrefillKilledMidTransferIsRetriedElsewhereAndTakenBackWhenRestarted) {
  const double quarantined_before = QuarantinedReservations();
  const absl::Duration budget = absl::Seconds(60);
  auto burst = StartBurst("kill-prefill", 6 * Scale(), budget);
  // Mid-transfer: prefill-0 holds a request (computing and sending layer by layer).
  ASSERT_TRUE(WaitFor([] { return PrefillLoad(kPrefill0).running_requests() > 0; }))
      << "prefill-0 never got a request";
  kill((*procs_)[kPrefill0]->pid(), SIGKILL);
  // Failures before the first token are retried on another pair: every request succeeds.
  EXPECT_EQ(JoinBurst(*burst, budget, /*allow_errors=*/false), 6 * Scale());
  EXPECT_FALSE((*procs_)[kPrefill0]->Running());
  // The decode node that was being written held its pages (a dead peer's puts may still be in
  // flight), and gave them back after the lease (checked in TearDown).
  EXPECT_GT(QuarantinedReservations(), quarantined_before);
  // Routed around: the router drops it, and new requests succeed on prefill-1.
  ASSERT_TRUE(WaitHealthy(2, 1, kGenerousWait).ok());
  EXPECT_EQ(RunBurst("after-kill-prefill", 4), 4);
  // Taken back: restarted on the same address, it is healthy again and gets work.
  ASSERT_TRUE(StartHost(kPrefill0).ok()) << (*procs_)[kPrefill0]->LogTail();
  ASSERT_TRUE(WaitHealthy(2, 2, absl::Seconds(60)).ok());
  EXPECT_EQ(RunBurst("back-prefill", 6), 6);
  EXPECT_GE(Metric(kPrefill0, "fluxion_prefill_requests_total{code=\"OK\"}"), 1)
      << "the restarted prefill node got no request";
}

TEST_F(ClusterFaultsTest, DecodeKilledMidStreamFailsClearlyOthersSucceedAndItIsTakenBack) {
  std::atomic<bool> first{false};
  Result long_result;
  std::thread long_stream([&] {
    long_result = Generate(Address(kRouter),
                           Request("kill-decode-long", ReferencePrompt(0), 1500, absl::Seconds(90)),
                           absl::Seconds(95), &first);
  });
  ASSERT_TRUE(WaitFor([&] { return first.load(); })) << "the long request got no first token";
  const int victim = BusyDecodeNode();
  ASSERT_GE(victim, 0);
  kill((*procs_)[victim]->pid(), SIGKILL);
  long_stream.join();
  // The router noticed the death: a stream it had not seen end would run into its 90 s budget
  // instead, without blaming the decode node. Which node it was is the router's log's, not the
  // client's (no internal address in a client's error).
  EXPECT_FALSE(long_result.status.ok());
  EXPECT_THAT(long_result.status.error_message(), HasSubstr("the decode node"));
  EXPECT_THAT(long_result.status.error_message(), Not(HasSubstr(Address(victim))));
  EXPECT_THAT(long_result.status.error_message(), HasSubstr("after the first token"));
  EXPECT_LT(long_result.tokens.size(), 1500u);
  // New requests go to the survivor (the first may try the dead node and be retried).
  EXPECT_EQ(RunBurst("after-kill-decode", 4 * Scale()), 4 * Scale());
  ASSERT_TRUE(WaitHealthy(1, 2, kGenerousWait).ok());
  ASSERT_TRUE(StartHost(victim).ok()) << (*procs_)[victim]->LogTail();
  ASSERT_TRUE(WaitHealthy(2, 2, absl::Seconds(60)).ok());
  EXPECT_EQ(RunBurst("back-decode", 6), 6);
  EXPECT_GE(Metric(victim, "fluxion_decode_requests_total{code=\"OK\"}"), 1)
      << "the restarted decode node got no request";
}

TEST_F(ClusterFaultsTest, StoppedDecodeNodeIsRoutedAroundItsStreamEndsByDeadlineThenTakenBack) {
  std::atomic<bool> first{false};
  Result stalled;
  const absl::Duration stalled_budget = absl::Seconds(8);
  std::thread stream([&] {
    stalled = Generate(Address(kRouter),
                       Request("stop-decode-long", ReferencePrompt(1), 1500, stalled_budget),
                       stalled_budget + 2 * kNothingEndedIt, &first);
  });
  ASSERT_TRUE(WaitFor([&] { return first.load(); })) << "the long request got no first token";
  const int victim = BusyDecodeNode();
  ASSERT_GE(victim, 0);
  const double ok_before = Metric(victim, "fluxion_decode_requests_total{code=\"OK\"}");
  kill((*procs_)[victim]->pid(), SIGSTOP);
  ASSERT_TRUE(WaitHealthy(1, 2, kGenerousWait).ok()) << "the stopped node was not dropped";
  EXPECT_EQ(RunBurst("while-stopped", 4 * Scale()), 4 * Scale());
  stream.join();
  // The stalled stream ends with a clear error by its budget (it cannot finish 1,500 tokens):
  // the router's keepalive gives up on the stopped node first (UNAVAILABLE blaming the decode
  // node, without its address, "after the first token"), or the budget passes
  // (DEADLINE_EXCEEDED from the router, long before the client's own deadline).
  EXPECT_FALSE(stalled.status.ok());
  if (stalled.status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    EXPECT_THAT(stalled.status.error_message(), HasSubstr("the decode node"));
    EXPECT_THAT(stalled.status.error_message(), Not(HasSubstr(Address(victim))));
    EXPECT_THAT(stalled.status.error_message(), HasSubstr("after the first token"));
  } else {
    EXPECT_EQ(stalled.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << stalled.status.error_message();
  }
  EXPECT_LT(stalled.elapsed, stalled_budget + kNothingEndedIt);
  kill((*procs_)[victim]->pid(), SIGCONT);
  ASSERT_TRUE(WaitHealthy(2, 2, kGenerousWait).ok()) << "the resumed node was not taken back";
  EXPECT_EQ(RunBurst("after-cont", 6), 6);
  EXPECT_GT(Metric(victim, "fluxion_decode_requests_total{code=\"OK\"}"), ok_before)
      << "the resumed decode node got no request";
}

// The hard case for page reuse: a prefill node stopped with puts pending into a decode node's
// pages, for longer than that node's abort wait and quarantine, then resumed while those pages may
// belong to other requests. Every request decoded meanwhile and after must be exact.
TEST_F(ClusterFaultsTest, StoppedPrefillNodeResumedAfterTheQuarantineCorruptsNothing) {
  const absl::Duration short_budget = absl::Seconds(4);
  // Pin the victim: these requests name prefill-0 (one of the router's own, so it is accepted).
  auto pinned = StartBurst("stop-prefill", 4, short_budget, Address(kPrefill0));
  ASSERT_TRUE(WaitFor([] { return PrefillLoad(kPrefill0).running_requests() > 0; }))
      << "prefill-0 never got a request";
  const double quarantined_before = QuarantinedReservations();
  kill((*procs_)[kPrefill0]->pid(), SIGSTOP);
  // The pinned requests end by their budget, OK (if they had landed) or with a clear error.
  JoinBurst(*pinned, short_budget, /*allow_errors=*/true);
  ASSERT_TRUE(WaitHealthy(2, 1, kGenerousWait).ok());
  // The decode nodes got no answer from it (the call timed out, or their Abort went unanswered),
  // so they held the pages for the lease instead of freeing them.
  EXPECT_GT(QuarantinedReservations(), quarantined_before);
  // Past the abort wait (1 s) and the quarantine (2 s): the pages went back to the pool, while
  // prefill-0 stays stopped.
  for (int h : {kDecode0, kDecode1}) {
    const v1::DecodeLoad load = WaitIdle(h, kGenerousWait);  // every page free: none quarantined
    EXPECT_EQ(load.free_kv_pages(), load.total_kv_pages()) << kHostNames[h];
  }
  EXPECT_EQ(RunBurst("reuse-while-stopped", 6 * Scale()), 6 * Scale());
  // Resume it while new requests hold the pages it had been writing.
  auto during = StartBurst("reuse-at-resume", 8, absl::Seconds(60));
  kill((*procs_)[kPrefill0]->pid(), SIGCONT);
  EXPECT_EQ(JoinBurst(*during, absl::Seconds(60), false), 8);
  ASSERT_TRUE(WaitHealthy(2, 2, kGenerousWait).ok()) << "the resumed node was not taken back";
  EXPECT_EQ(RunBurst("after-resume", 6), 6);
  // And it serves again itself: its UCX endpoints to the decode nodes timed out while it was
  // stopped (UCX keepalive), so these need new ones.
  EXPECT_EQ(RunBurst("after-resume-pinned", 4, false, absl::Seconds(60), Address(kPrefill0)), 4);
}

// The link stays down for 3 s (x FLUXION_FAULTS_SCALE) and, for a decode host, until the
// requests sent meanwhile through *each* prefill node have finished: a prefill node with writes
// to the host whose link is down must keep serving the other decode node (it releases its compute
// slot when a forward ends and waits for each request's writes on that request's own thread;
// before that it stalled for everyone until its --transfer-timeout-ms, docs/FAULTS.md "Findings").
TEST_F(ClusterFaultsTest, LinkDownAndUpIsRoutedAroundAndTakenBack) {
  const absl::Duration down_for = absl::Seconds(3 * Scale());
  for (int victim : {kDecode1, kPrefill1}) {
    SCOPED_TRACE(kHostNames[victim]);
    // In flight when the link goes down: they end OK (TCP resumes after the flap) or with a clear
    // error, within their budget. The link goes down once the router has them (or, on a fast
    // machine, has already answered some).
    const double ok_before = RouterOk();
    auto in_flight = StartBurst(absl::StrCat("flap-", victim), 6, absl::Seconds(60));
    EXPECT_TRUE(WaitFor([&] { return RouterInflight() > 0 || RouterOk() > ok_before; },
                        kGenerousWait, absl::Milliseconds(20)));
    ASSERT_TRUE(lab_->LinkDown(victim).ok());
    const absl::Time down_at = absl::Now();
    const bool decode = victim == kDecode1;
    // Routed around: the router drops the node, and requests sent meanwhile all succeed.
    ASSERT_TRUE(WaitHealthy(decode ? 1 : 2, decode ? 2 : 1, kGenerousWait).ok());
    if (decode) {
      // Through each prefill node, while decode-1 still cannot be reached: every one succeeds.
      auto via_0 = StartBurst("link-down-p0", 2, absl::Seconds(60), Address(kPrefill0));
      auto via_1 = StartBurst("link-down-p1", 2, absl::Seconds(60), Address(kPrefill1));
      EXPECT_EQ(JoinBurst(*via_0, absl::Seconds(60), /*allow_errors=*/false), 2);
      EXPECT_EQ(JoinBurst(*via_1, absl::Seconds(60), /*allow_errors=*/false), 2);
      absl::SleepFor(down_for - (absl::Now() - down_at));  // the fault: down for at least this
      ASSERT_TRUE(lab_->LinkUp(victim).ok());
    } else {
      auto while_down = StartBurst(absl::StrCat("link-down-", victim), 4, absl::Seconds(60));
      absl::SleepFor(down_for - (absl::Now() - down_at));  // the fault: down for at least this
      ASSERT_TRUE(lab_->LinkUp(victim).ok());
      EXPECT_EQ(JoinBurst(*while_down, absl::Seconds(60), /*allow_errors=*/false), 4);
    }
    JoinBurst(*in_flight, absl::Seconds(60), /*allow_errors=*/true);
    // Taken back once its health checks pass again.
    ASSERT_TRUE(WaitHealthy(2, 2, kGenerousWait).ok()) << "not taken back after link up";
    EXPECT_EQ(RunBurst(absl::StrCat("link-up-", victim), 6), 6);
  }
}

TEST_F(ClusterFaultsTest, LossAndARateLimitOnThePrefillLinkKeepEveryAnswerExact) {
  // 5% of TCP packets in and out of prefill-0 dropped, its sends limited to 20 Mbit/s; every
  // request goes through it. (Delay: the next case.)
  absl::Status loss = lab_->Loss(kPrefill0, 5);
  ASSERT_TRUE(loss.ok()) << loss;
  absl::Status rate = lab_->RateLimit(kPrefill0, "20mbit");
  ASSERT_TRUE(rate.ok()) << rate;
  EXPECT_EQ(RunBurst("loss", 6 * Scale(), false, absl::Seconds(90), Address(kPrefill0)),
            6 * Scale());
  // The loss was real: the rules dropped packets of these transfers and calls.
  auto dropped = lab_->DroppedPackets(kPrefill0);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_GT(*dropped, 0);
  std::cerr << "loss: nft dropped " << *dropped << " TCP packets of prefill-0\n";
  ASSERT_TRUE(lab_->ClearShaping(kPrefill0).ok());
}

// How long a TCP handshake with ip:port takes from the test's namespace (a SYN to the host, a
// SYN-ACK back), or an error.
absl::StatusOr<absl::Duration> ConnectTime(const std::string& ip, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  const absl::Time start = absl::Now();
  const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const absl::Duration took = absl::Now() - start;
  close(fd);
  if (rc != 0) return absl::UnavailableError(absl::StrCat("connect to ", ip, ":", port, " failed"));
  return took;
}

TEST_F(ClusterFaultsTest, DelayOnThePrefillLinkKeepsEveryAnswerExact) {
  // 40 ms added to every packet prefill-0 sends or receives (tests/link_delay behind NFQUEUE
  // rules: this kernel has no tc netem), so its gRPC calls, health checks and the layer-wise KV
  // writes to either decode node all cross an 80 ms round trip; every request goes through it.
  constexpr int kDelayMs = 40;
  absl::Status delay = lab_->Delay(kPrefill0, kDelayMs, FLUXION_LINK_DELAY);
  ASSERT_TRUE(delay.ok()) << delay;
  // The delay is real: a handshake with the host takes at least a SYN in and a SYN-ACK out.
  auto rtt = ConnectTime(lab_->ip(kPrefill0), PortOf(kPrefill0));
  ASSERT_TRUE(rtt.ok()) << rtt.status();
  EXPECT_GE(*rtt, absl::Milliseconds(2 * kDelayMs));
  std::cerr << "delay: handshake with prefill-0 took " << absl::FormatDuration(*rtt) << "\n";
  EXPECT_EQ(RunBurst("delay", 6 * Scale(), false, absl::Seconds(90), Address(kPrefill0)),
            6 * Scale());
  // ClearShaping fails unless the NFQUEUE rules and the delay program are gone; a handshake
  // still works afterwards (its time is printed: an upper bound on it would time the machine).
  ASSERT_TRUE(lab_->ClearShaping(kPrefill0).ok());
  auto after = ConnectTime(lab_->ip(kPrefill0), PortOf(kPrefill0));
  ASSERT_TRUE(after.ok()) << after.status();
  std::cerr << "delay cleared: handshake with prefill-0 took " << absl::FormatDuration(*after)
            << "\n";
}

TEST_F(ClusterFaultsTest, CancelStormGivesEveryPageBack) {
  cluster::SyntheticOptions synthetic;
  synthetic.num_requests = 40 * Scale();
  synthetic.rate = 40;
  synthetic.input = *cluster::ParseLengthDistribution("uniform:64:256");
  // 1,500 tokens cannot finish within the 0.3 s before each cancel on any machine.
  synthetic.output = *cluster::ParseLengthDistribution("fixed:1500");
  cluster::ReplayOptions options;
  options.target = Address(kRouter);
  options.progress = false;
  options.vocab_size = 256;
  options.timeout_s = 60;
  options.cancel_fraction = 1.0;
  options.cancel_after_s = 0.3;
  auto records = cluster::Replayer(options).Run(cluster::MakeSyntheticSchedule(synthetic));
  ASSERT_TRUE(records.ok()) << records.status();
  for (const cluster::RequestRecord& r : *records) {
    EXPECT_TRUE(r.cancelled_by_client)
        << r.request_id << ": " << r.status_code << " " << r.status_message;
  }
  // TearDown checks that both decode nodes are idle with every page free and both prefill nodes
  // idle: cancellation crossed the router, the decode nodes and reached the prefill nodes.
}

TEST_F(ClusterFaultsTest, OverloadEndsEveryRequestWithTokensOrAClearErrorInTime) {
  cluster::SyntheticOptions synthetic;
  synthetic.num_requests = 48 * Scale();
  synthetic.rate = 0;  // all at once: far more KV than the two 6,144-page arenas hold
  synthetic.input = *cluster::ParseLengthDistribution("uniform:300:700");
  synthetic.output = *cluster::ParseLengthDistribution("fixed:16");
  cluster::ReplayOptions options;
  options.target = Address(kRouter);
  options.progress = false;
  options.vocab_size = 256;
  options.timeout_s = 60;
  auto records = cluster::Replayer(options).Run(cluster::MakeSyntheticSchedule(synthetic));
  ASSERT_TRUE(records.ok()) << records.status();
  int ok = 0;
  std::map<int, int> codes;
  // In time: the replayer's own gRPC deadline (timeout_s + 1 s) bounds every request, so what is
  // checked is how each ended.
  for (const cluster::RequestRecord& r : *records) {
    if (r.ok()) {
      ++ok;
      EXPECT_EQ(r.output_tokens, 16) << r.request_id;
      continue;
    }
    ++codes[r.status_code];
    EXPECT_THAT(r.status_code, ::testing::AnyOf(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                                grpc::StatusCode::UNAVAILABLE,
                                                grpc::StatusCode::DEADLINE_EXCEEDED))
        << r.request_id << ": " << r.status_message;
    EXPECT_FALSE(r.status_message.empty()) << r.request_id;
  }
  EXPECT_GT(ok, 0);
  std::cerr << "overload: " << ok << " of " << records->size() << " succeeded; errors by code:";
  for (const auto& [code, n] : codes) std::cerr << " " << code << "=" << n;
  std::cerr << "\n";
  // And the cluster still answers exactly afterwards.
  EXPECT_EQ(RunBurst("after-overload", 4), 4);
}

TEST_F(ClusterFaultsTest, RollingRestartUnderLoadFailsNoRequestBeforeItsFirstToken) {
  // Poisson load at 3 req/s that runs until both restarts are done (then it is interrupted), so
  // the restarts happen under load however long they take on this machine.
  cluster::SyntheticOptions synthetic;
  synthetic.num_requests = 1800;
  synthetic.rate = 3;
  synthetic.input = *cluster::ParseLengthDistribution("uniform:64:256");
  synthetic.output = *cluster::ParseLengthDistribution("fixed:24");
  cluster::ReplayOptions options;
  options.target = Address(kRouter);
  options.progress = false;
  options.vocab_size = 256;
  options.timeout_s = 120;
  cluster::Replayer replayer(options);
  absl::StatusOr<std::vector<cluster::RequestRecord>> records;
  std::thread load([&] { records = replayer.Run(cluster::MakeSyntheticSchedule(synthetic)); });
  // One node of each kind, one after the other: SIGTERM (drain), wait for it to exit by itself,
  // start it again on the same address, wait until the router uses it again. Each step waits
  // for the load to have moved on (the router answered more requests OK) rather than for a time.
  auto load_moves_on = [&](int answers) {
    const double ok = RouterOk();
    return WaitFor([&] { return RouterOk() >= ok + answers; }, kGenerousWait,
                   absl::Milliseconds(100));
  };
  for (int h : {kPrefill0, kDecode0}) {
    EXPECT_TRUE(load_moves_on(4 * Scale())) << "no load before restarting " << kHostNames[h];
    const std::string how = (*procs_)[h]->Stop(absl::Seconds(60));
    EXPECT_THAT(how, HasSubstr("exited 0")) << kHostNames[h];
    ASSERT_TRUE(StartHost(h).ok()) << (*procs_)[h]->LogTail();
    ASSERT_TRUE(WaitHealthy(2, 2, absl::Seconds(60)).ok()) << kHostNames[h];
  }
  EXPECT_TRUE(load_moves_on(4)) << "no load after the restarts";
  replayer.Interrupt();  // cancels what is still in flight: CANCELLED, not a failure
  load.join();
  ASSERT_TRUE(records.ok()) << records.status();
  int ok = 0, failed_before_first = 0, failed_after_first = 0;
  for (const cluster::RequestRecord& r : *records) {
    if (r.ok()) ++ok;
    if (r.ok() || r.status_code == grpc::StatusCode::CANCELLED) continue;
    (r.has_first_token() ? failed_after_first : failed_before_first)++;
    std::cerr << "rolling restart: " << r.request_id << " failed "
              << (r.has_first_token() ? "after" : "before") << " its first token: " << r.status_code
              << " " << r.status_message << "\n";
  }
  EXPECT_EQ(failed_before_first, 0);
  EXPECT_GT(ok, 0);
  std::cerr << "rolling restart: " << records->size() << " requests sent, " << ok << " succeeded, "
            << failed_after_first << " failed after their first token\n";
}

}  // namespace
}  // namespace fluxion::testing
