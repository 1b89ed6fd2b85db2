#include "cluster/replay_sampler.h"

#include <unistd.h>

#include <algorithm>

#include "cluster/fake_decode_service.h"
#include "common/wait_testing.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

namespace v1 = ::fluxion::v1;

TEST(ParseSamplePidsTest, NamesAndPids) {
  auto p = ParseSamplePids("router=12,decode-0=345");
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 2u);
  EXPECT_EQ((*p)[0].name, "router");
  EXPECT_EQ((*p)[0].pid, 12);
  EXPECT_EQ((*p)[1].name, "decode-0");
  EXPECT_EQ((*p)[1].pid, 345);
  EXPECT_TRUE(ParseSamplePids("")->empty());
}

TEST(ParseSamplePidsTest, RejectsMalformedEntries) {
  for (const char* bad :
       {"router", "=12", "router=", "router=0", "router=-3", "router=x", "a=1,a=2", "a=1,,b=2"}) {
    auto p = ParseSamplePids(bad);
    EXPECT_FALSE(p.ok()) << bad;
    EXPECT_NE(p.status().message().find("--sample-pids"), std::string::npos) << bad;
  }
}

TEST(ParseProcStatusTest, ReadsRssAndThreads) {
  auto u = ParseProcStatus("Name:\tfluxion\nVmPeak:\t  900 kB\nVmRSS:\t  2048 kB\nThreads:\t17\n");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->rss_bytes, 2048 * 1024);
  EXPECT_EQ(u->threads, 17);
  // A zombie has no VmRSS: reported as gone, not as 0 bytes.
  EXPECT_EQ(ParseProcStatus("Name:\tx\nThreads:\t1\n").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ParseProcStatus("VmRSS:\t12 MB\nThreads:\t1\n").status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(ReadProcessUsageTest, ThisProcess) {
  auto u = ReadProcessUsage(getpid());
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_GT(u->rss_bytes, 1 << 20);
  EXPECT_GE(u->threads, 1);
}

TEST(ResourceSamplerTest, ProcessesOnlyReportsTrendsAndAGoneProcess) {
  // No target (no GetLoad), this process and a pid that cannot exist (above pid_max).
  SamplerOptions o;
  o.processes = {{"self", getpid()}, {"gone", 1 << 30}};
  o.interval = absl::Milliseconds(20);
  o.warmup = absl::ZeroDuration();
  ResourceSampler sampler(o);
  // Start and Finish take a sample each, whatever happens between them (the periodic samples are
  // checked below, with a target that counts them).
  sampler.Start();
  SamplerReport r = sampler.Finish();
  ASSERT_EQ(r.processes.size(), 2u);
  EXPECT_FALSE(r.processes[0].died);
  EXPECT_GE(r.processes[0].samples, 2);
  EXPECT_GT(r.processes[0].rss_after_warmup, 0);
  EXPECT_TRUE(r.processes[1].died);
  EXPECT_FALSE(r.have_load);
  const std::string table = FormatSamplerReport(r, o.warmup);
  EXPECT_NE(table.find("DIED"), std::string::npos) << table;
  nlohmann::json j = SamplerReportToJson(r, o.warmup);
  EXPECT_TRUE(j["processes"][1]["died"].get<bool>());
  EXPECT_FALSE(j.contains("pages_back_to_baseline"));
}

v1::DecodeLoad LoadWith(uint64_t free_pages, uint32_t running) {
  v1::DecodeLoad l;
  l.set_total_kv_pages(1000);
  l.set_free_kv_pages(free_pages);
  l.set_running_requests(running);
  return l;
}

TEST(ResourceSamplerTest, PagesBackToBaselineOnlyWhenTheTargetGivesThemBack) {
  testing::FakeDecodeService service;
  testing::FakeServer server(&service, "fluxion.v1.DecodeService");
  for (bool leak : {false, true}) {
    SCOPED_TRACE(leak ? "leaked" : "given back");
    service.SetLoad(LoadWith(1000, 0));
    SamplerOptions o;
    o.target = server.address();
    o.interval = absl::Milliseconds(20);
    o.warmup = absl::ZeroDuration();
    o.settle = absl::Milliseconds(300);
    ResourceSampler sampler(o);
    sampler.Start();
    // The run: pages in use, until the sampler's own thread has sampled them (two more GetLoad
    // calls: the second began after the first, so after the new load was set).
    const int calls = service.load_calls();
    service.SetLoad(LoadWith(400, 3));
    ASSERT_TRUE(WaitFor([&] { return service.load_calls() >= calls + 2; }));
    service.SetLoad(leak ? LoadWith(990, 0) : LoadWith(1000, 0));  // idle: all back, or 10 short
    SamplerReport r = sampler.Finish();
    ASSERT_TRUE(r.have_load);
    EXPECT_EQ(r.first_load.free_kv_pages, 1000u);
    EXPECT_EQ(r.final_load.free_kv_pages, leak ? 990u : 1000u);
    EXPECT_EQ(r.pages_back_to_baseline, !leak);
    EXPECT_GE(r.load_samples.size(), 3u);
    EXPECT_TRUE(std::any_of(r.load_samples.begin(), r.load_samples.end(),
                            [](const LoadSample& l) { return l.free_kv_pages == 400; }))
        << "no periodic sample saw the run";
    const std::string table = FormatSamplerReport(r, o.warmup);
    EXPECT_NE(table.find(leak ? "NOT back to baseline" : "back to baseline"), std::string::npos)
        << table;
  }
}

}  // namespace
}  // namespace fluxion::cluster
