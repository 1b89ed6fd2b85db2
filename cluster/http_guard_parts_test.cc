// The HTTP API's guards on their own: the bounded worker pool, the connection limiter and its
// rate-limited log, the hang-up watcher. Waits are on conditions with generous deadlines.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "cluster/http_connection_limits.h"
#include "cluster/http_hangup_watcher.h"
#include "cluster/worker_pool.h"
#include "common/metrics.h"
#include "common/metrics_names.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kPatience = absl::Seconds(30);

TEST(WorkerPoolTest, QueueIsBoundedBeyondTheBusyThreadsAndDrainedOnStop) {
  WorkerPool pool(/*threads=*/1, /*max_queued=*/1);
  absl::Notification started, release;
  std::atomic<int> ran{0};
  ASSERT_TRUE(pool.TrySubmit([&] {
    started.Notify();
    release.WaitForNotificationWithTimeout(kPatience);
    ++ran;
  }));
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(kPatience));
  EXPECT_TRUE(pool.TrySubmit([&] { ++ran; }));   // waits for the thread
  EXPECT_FALSE(pool.TrySubmit([&] { ++ran; }));  // one waits already: refused, never run
  release.Notify();
  pool.Stop();
  EXPECT_EQ(ran.load(), 2);
  EXPECT_FALSE(pool.TrySubmit([&] { ++ran; }));  // stopped
}

TEST(WorkerPoolTest, AnIdleThreadTakesAJobEvenWithNoQueue) {
  WorkerPool pool(/*threads=*/2, /*max_queued=*/0);
  absl::Notification done;
  ASSERT_TRUE(pool.TrySubmit([&] { done.Notify(); }));
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(kPatience));
}

TEST(ConnectionLimiterTest, LimitsPerClientAndInAllCountsAndLogsRateLimited) {
  metrics::Registry registry;
  std::vector<std::string> lines;
  absl::Time now = absl::FromUnixSeconds(1000);
  ConnectionLimiter limiter(
      {/*total=*/3, /*per_client=*/2}, &registry,
      [&](const std::string& line) { lines.push_back(line); }, [&] { return now; });
  auto refused = [&](const char* reason) {
    return registry
        .AddCounter(metrics::names::kRouterHttpConnectionsRefusedTotal, "", {{"reason", reason}})
        ->value();
  };
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(limiter.Admit("10.0.0.1"));
    limiter.Opened("10.0.0.1");
  }
  EXPECT_FALSE(limiter.Admit("10.0.0.1"));
  EXPECT_FALSE(limiter.Admit("10.0.0.1"));
  ASSERT_TRUE(limiter.Admit("10.0.0.2"));
  limiter.Opened("10.0.0.2");
  EXPECT_FALSE(limiter.Admit("10.0.0.3"));  // 3 open in all
  EXPECT_EQ(refused("per_client"), 2);
  EXPECT_EQ(refused("total"), 1);
  ASSERT_EQ(lines.size(), 1u);  // the first refusal logs; the next ones wait for the interval
  EXPECT_THAT(lines[0], HasSubstr("10.0.0.1"));
  now += absl::Seconds(11);
  EXPECT_FALSE(limiter.Admit("10.0.0.3"));
  ASSERT_EQ(lines.size(), 2u);  // the interval passed: the next refusal logs, with the counts since
  EXPECT_THAT(lines[1], HasSubstr("1 over the per-client limit"));
  EXPECT_THAT(lines[1], HasSubstr("2 over the total limit"));
  limiter.Closed("10.0.0.1");
  EXPECT_TRUE(limiter.Admit("10.0.0.1"));
  EXPECT_TRUE(limiter.Admit("10.0.0.3"));
}

TEST(ConnectionLimiterTest, NoPerClientLimitWhenZero) {
  metrics::Registry registry;
  ConnectionLimiter limiter({/*total=*/100, /*per_client=*/0}, &registry,
                            [](const std::string&) {});
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(limiter.Admit("10.0.0.1"));
    limiter.Opened("10.0.0.1");
  }
}

TEST(HangupWatcherTest, RunsOnceWhenThePeerClosesAndNeverAfterUnwatch) {
  auto watcher = HangupWatcher::Start();
  ASSERT_TRUE(watcher.ok()) << watcher.status();
  int a[2], b[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, a), 0);
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, b), 0);
  absl::Notification hung_up;
  std::atomic<int> calls{0};
  const uint64_t watched = (*watcher)->Watch(a[0], [&] {
    ++calls;
    hung_up.Notify();
  });
  ASSERT_NE(watched, 0u);
  const uint64_t forgotten = (*watcher)->Watch(b[0], [&] { ++calls; });
  ASSERT_NE(forgotten, 0u);
  (*watcher)->Unwatch(forgotten);
  close(b[1]);
  EXPECT_EQ(write(a[1], "x", 1), 1);  // data is no hang-up
  close(a[1]);
  EXPECT_TRUE(hung_up.WaitForNotificationWithTimeout(kPatience));
  (*watcher)->Unwatch(watched);
  EXPECT_EQ((*watcher)->watched(), 0u);
  watcher->reset();  // joins: any late callback would have run by now
  EXPECT_EQ(calls.load(), 1);
  close(a[0]);
  close(b[0]);
}

}  // namespace
}  // namespace fluxion::cluster
