#include "common/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <vector>

#include "absl/time/clock.h"
#include "common/metrics_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::metrics {
namespace {

using ::testing::HasSubstr;

// One server (and registry) for the suite.
class MetricsHttpServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    registry_ = new Registry();
    registry_->AddCounter("fluxion_test_requests_total", "Requests by code.", {{"code", "OK"}})
        ->Increment(2);
    registry_->AddGauge("fluxion_test_requests_running", "Running requests.")->Set(3);
    registry_->AddGaugeCallback("fluxion_test_kv_pages_free", "Free KV pages.", {},
                                [] { return 7; });
    registry_->AddHistogram("fluxion_test_time_to_first_token_seconds", "TTFT.",
                            LatencyBuckets())
        ->Observe(0.2);
    auto server = MetricsHttpServer::Start("127.0.0.1:0", registry_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete registry_;
  }
  static Registry* registry_;
  static MetricsHttpServer* server_;
};
Registry* MetricsHttpServerTest::registry_ = nullptr;
MetricsHttpServer* MetricsHttpServerTest::server_ = nullptr;

TEST_F(MetricsHttpServerTest, ServesTheRegistryAtMetricsOnAPickedPort) {
  ASSERT_GT(server_->port(), 0);
  auto body = testing::HttpGet(server_->port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("fluxion_test_requests_total{code=\"OK\"} 2\n"));
  EXPECT_THAT(*body, HasSubstr("fluxion_test_kv_pages_free 7\n"));
  EXPECT_FALSE(testing::HttpGet(server_->port(), "/other").ok());
}

TEST_F(MetricsHttpServerTest, ReadyzFollowsTheReadinessFunctionAndLivezAlwaysAnswers) {
  auto server = MetricsHttpServer::Start("127.0.0.1:0", registry_);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  // Before SetReadiness: not ready (a server still loading), alive.
  auto before = testing::HttpGet(port, "/readyz");
  ASSERT_FALSE(before.ok());
  EXPECT_THAT(before.status().message(), HasSubstr("503"));
  EXPECT_TRUE(testing::HttpGet(port, "/livez").ok());
  std::atomic<bool> ready{true};
  (*server)->SetReadiness([&ready] { return ready.load(); });
  auto now = testing::HttpGet(port, "/readyz");
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(*now, "ready\n");
  ready = false;  // draining
  auto draining = testing::HttpGet(port, "/readyz");
  ASSERT_FALSE(draining.ok());
  EXPECT_THAT(draining.status().message(), HasSubstr("503"));
  EXPECT_TRUE(testing::HttpGet(port, "/livez").ok());
  EXPECT_TRUE(testing::HttpGet(port, "/metrics").ok());
}

TEST_F(MetricsHttpServerTest, BusyPortIsUnavailable) {
  auto second = MetricsHttpServer::Start("127.0.0.1:" + std::to_string(server_->port()), registry_);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(MetricsHttpServerTest, PromtoolAcceptsEveryMetricType) {
  if (!testing::HavePromtool()) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  auto body = testing::HttpGet(server_->port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  absl::Status check = testing::PromtoolCheck(*body);
  EXPECT_TRUE(check.ok()) << check << "\n" << *body;
}

TEST_F(MetricsHttpServerTest, PromtoolRejectsABrokenExposition) {
  if (!testing::HavePromtool()) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  // Guards the check itself: a counter without _total and without HELP must fail the lint.
  EXPECT_FALSE(testing::PromtoolCheck("# TYPE requests counter\nrequests 1\n").ok());
}

// Opens `count` TCP connections to 127.0.0.1:`port` from source address `source` that send nothing
// (even ones) or half a request line (odd ones) and stay open: idle or slow clients, or a port scan
// that never closes. Returns the sockets; fails when the process lacks descriptors.
absl::StatusOr<std::vector<int>> OpenIdleConnections(int port, const char* source, int count) {
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return absl::ResourceExhaustedError(absl::StrCat("socket #", i));
    fds.push_back(fd);
    sockaddr_in from{};
    from.sin_family = AF_INET;
    inet_pton(AF_INET, source, &from.sin_addr);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0 ||
        connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
      return absl::UnavailableError(absl::StrCat("connection #", i, " from ", source));
    }
    if (i % 2 == 1) (void)!write(fd, "GET /metr", 9);
  }
  return fds;
}

// Every idle connection costs this process two descriptors (both ends are here).
bool RaiseDescriptorLimit(rlim_t want) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return false;
  if (limit.rlim_cur >= want) return true;
  if (limit.rlim_max < want) return false;
  limit.rlim_cur = want;
  return setrlimit(RLIMIT_NOFILE, &limit) == 0;
}

// Idle connections are closed after an hour here, far beyond the scraper's 60 s: a scrape that had
// to wait for a slot in a full table would wait the hour and fail on its read timeout, whatever
// the machine's speed. (Before the fix it waited for the default 10 s idle timeout.)
constexpr absl::Duration kIdleForever = absl::Hours(1);
constexpr absl::Duration kScrapeTimeout = absl::Seconds(60);

void ExpectScrapeAnswersDespiteIdleConnections(const char* source) {
  // The server sizes its table from RLIMIT_NOFILE (a quarter of it): 16384 gives the full 4096.
  if (!RaiseDescriptorLimit(16384)) GTEST_SKIP() << "needs 16384 file descriptors (ulimit -Hn)";
  Registry registry;
  registry.AddGauge("fluxion_test_up", "Up.")->Set(1);
  MetricsHttpServer::Limits limits = MetricsHttpServer::DefaultLimits();
  limits.idle_timeout = kIdleForever;
  auto server = MetricsHttpServer::Start("127.0.0.1:0", &registry, limits);
  ASSERT_TRUE(server.ok()) << server.status();
  auto idle = OpenIdleConnections((*server)->port(), source, 1100);
  ASSERT_TRUE(idle.ok()) << idle.status();
  auto body = testing::HttpGet((*server)->port(), "/metrics", kScrapeTimeout);
  for (int fd : *idle) close(fd);
  ASSERT_TRUE(body.ok()) << body.status() << " (the scrape waited for the idle connections)";
  EXPECT_THAT(*body, HasSubstr("fluxion_test_up 1\n"));
}

// The idle connections come from another address (127.0.0.2; all of 127/8 is loopback on Linux).
TEST(MetricsHttpServerLimitsTest, IdleConnectionsFromAnotherHostDoNotStallAScrape) {
  ExpectScrapeAnswersDespiteIdleConnections("127.0.0.2");
}

// The idle connections come from the scraper's own address.
TEST(MetricsHttpServerLimitsTest, IdleConnectionsFromTheScrapersHostDoNotStallAScrape) {
  ExpectScrapeAnswersDespiteIdleConnections("127.0.0.1");
}

// A client that opens more than its share of the table is refused beyond it, so a scraper from
// another address still gets in when the table would otherwise be full.
TEST(MetricsHttpServerLimitsTest, OneAddressCannotFillTheTable) {
  Registry registry;
  registry.AddGauge("fluxion_test_up", "Up.")->Set(1);
  MetricsHttpServer::Limits limits;
  limits.max_connections = 64;
  limits.max_connections_per_address = 32;
  limits.idle_timeout = kIdleForever;
  auto server = MetricsHttpServer::Start("127.0.0.1:0", &registry, limits);
  ASSERT_TRUE(server.ok()) << server.status();
  // Connecting succeeds beyond the share (the kernel accepts into the backlog); the server then
  // closes the extra ones.
  auto idle = OpenIdleConnections((*server)->port(), "127.0.0.2", 100);
  ASSERT_TRUE(idle.ok()) << idle.status();
  auto body = testing::HttpGet((*server)->port(), "/metrics", kScrapeTimeout);
  for (int fd : *idle) close(fd);
  ASSERT_TRUE(body.ok()) << body.status() << " (the table was full of one address's connections)";
}

}  // namespace
}  // namespace fluxion::metrics
