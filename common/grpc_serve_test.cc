#include "common/grpc_serve.h"

#include <pthread.h>
#include <signal.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "gtest/gtest.h"

namespace fluxion::serving {
namespace {

TEST(ReportStartErrorTest, InvalidArgumentIsAUsageErrorAndTheRestFailToStart) {
  EXPECT_EQ(ReportStartError(absl::InvalidArgumentError("--x must be positive")), 2);
  EXPECT_EQ(ReportStartError(absl::FailedPreconditionError("cannot load model")), 1);
  EXPECT_EQ(ReportStartError(absl::UnavailableError("port in use")), 1);
}

TEST(GrpcServeTest, ServesOnAFreePortWithoutMetricsAndDrainsWithNothingLive) {
  v1::PrefillService::Service service;  // every method UNIMPLEMENTED: only the server matters
  ServeConfig config;
  config.listen = "127.0.0.1:0";
  auto serve = GrpcServe::Start(config, {&service}, &metrics::Registry::Default(), nullptr);
  ASSERT_TRUE(serve.ok()) << serve.status();
  EXPECT_GT((*serve)->port(), 0);
  EXPECT_EQ((*serve)->metrics_port(), 0);
  (*serve)->SetServing({"fluxion.v1.PrefillService"}, true);
  bool draining = false;
  DrainPlan plan;
  plan.start_draining = [&] { draining = true; };
  plan.live_requests = [] { return int64_t{0}; };
  plan.timeout = absl::Seconds(5);
  EXPECT_EQ((*serve)->Drain(plan), 0);
  EXPECT_TRUE(draining);
}

TEST(GrpcServeTest, AnAddressItCannotBindIsUnavailableNotAUsageError) {
  v1::PrefillService::Service service;
  ServeConfig config;
  config.listen = "192.0.2.1:0";  // TEST-NET-1 (RFC 5737): no interface of this host has it
  auto serve = GrpcServe::Start(config, {&service}, &metrics::Registry::Default(), nullptr);
  ASSERT_FALSE(serve.ok());
  EXPECT_EQ(serve.status().code(), absl::StatusCode::kUnavailable);
}

TEST(WaitForStopSignalTest, ABlockedSignalThatArrivedEarlierEndsTheWaitAfterATick) {
  // BlockStopSignals' contract: a SIGTERM that arrives before the wait is kept, not lost. Run on
  // a thread of its own so that the test process's own mask stays as it was.
  int ticks = 0;
  std::thread waiter([&] {
    BlockStopSignals();
    pthread_kill(pthread_self(), SIGTERM);  // pending: blocked in this thread
    WaitForStopSignal(absl::Milliseconds(10), [&] { ++ticks; });
  });
  waiter.join();
  EXPECT_GE(ticks, 1);
}

}  // namespace
}  // namespace fluxion::serving
