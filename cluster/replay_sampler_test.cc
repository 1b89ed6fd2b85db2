#include "cluster/replay_sampler.h"

#include <unistd.h>

#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

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
  for (const char* bad : {"router", "=12", "router=", "router=0", "router=-3", "router=x",
                          "a=1,a=2", "a=1,,b=2"}) {
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
  EXPECT_EQ(ParseProcStatus("Name:\tx\nThreads:\t1\n").status().code(), absl::StatusCode::kNotFound);
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
  sampler.Start();
  absl::SleepFor(absl::Milliseconds(100));
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

}  // namespace
}  // namespace fluxion::cluster
