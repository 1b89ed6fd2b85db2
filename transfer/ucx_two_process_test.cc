// UCX between two processes, the way prefill and decode nodes use it: the test process is the
// writer (prefill side); a forked child owns the registered memory (decode side), sends its
// descriptor over a pipe and answers commands (checksum its memory, pause or resume its progress).
// The child is forked before this process starts any thread or UCX object, and every read from it
// has a deadline. Covers what one process cannot: CMA/shared memory between address spaces, and a
// peer killed with SIGKILL while a batch is in flight.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transfer/transport.h"
#include "transfer/ucx_transport.h"

namespace fluxion::transfer {
namespace {

constexpr size_t kPage = 8192;
constexpr size_t kPages = 256;  // 2 MiB
constexpr size_t kBytes = kPage * kPages;
constexpr absl::Duration kLongWait = absl::Seconds(10);

using Config = std::vector<std::pair<std::string, std::string>>;

CompatibilityRecord TestCompat() {
  CompatibilityRecord c;
  c.model_id = "sha256:test-model";
  c.kv_dtype = 2;
  c.num_layers = 4;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.page_tokens = 16;
  c.layout_version = 1;
  return c;
}

UcxOptions Options(const std::string& node, const Config& config, bool peer_errors) {
  UcxOptions o;
  o.node_name = node;
  o.compat = TestCompat();
  o.config = config;
  o.peer_error_handling = peer_errors;
  return o;
}

uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

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

// Reads exactly n bytes or fails at the deadline / EOF.
bool ReadAll(int fd, void* p, size_t n, absl::Time deadline) {
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

// The child: owns the target memory. Exits when told to, or when the parent goes silent.
[[noreturn]] void RunTarget(int cmd_fd, int reply_fd, const std::string& node, const Config& config,
                            bool peer_errors) {
  auto transport = NewUcxTransport(Options(node, config, peer_errors));
  if (!transport.ok()) _exit(2);
  std::vector<uint8_t> memory(kBytes, 0);
  auto reg = (*transport)->Register({memory.data(), memory.size()});
  if (!reg.ok()) _exit(3);
  const std::string blob = SerializeDescriptor(*(*reg)->Describe());
  const uint32_t size = static_cast<uint32_t>(blob.size());
  if (!WriteAll(reply_fd, &size, sizeof(size)) || !WriteAll(reply_fd, blob.data(), size)) _exit(4);
  for (;;) {
    char cmd;
    if (!ReadAll(cmd_fd, &cmd, 1, absl::Now() + absl::Seconds(60))) break;
    if (cmd == 'Q') break;
    if (cmd == 'C') {
      const uint64_t h = Fnv1a(memory.data(), memory.size());
      WriteAll(reply_fd, &h, sizeof(h));
    } else if (cmd == 'P' || cmd == 'R') {
      (*transport)->SetProgressPausedForTesting(cmd == 'P');
      WriteAll(reply_fd, "k", 1);
    }
  }
  reg->reset();
  transport->reset();
  _exit(0);
}

// A forked target process. Killed (SIGKILL) and reaped on destruction if still running.
class TargetProcess {
 public:
  static std::unique_ptr<TargetProcess> Start(const std::string& node, const Config& config,
                                              bool peer_errors) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return nullptr;
    const pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      close(to_child[1]);
      close(from_child[0]);
      RunTarget(to_child[0], from_child[1], node, config, peer_errors);
    }
    close(to_child[0]);
    close(from_child[1]);
    return std::unique_ptr<TargetProcess>(new TargetProcess(pid, to_child[1], from_child[0]));
  }
  ~TargetProcess() {
    Kill();
    close(cmd_fd_);
    close(reply_fd_);
  }

  absl::StatusOr<PeerDescriptor> Descriptor() {
    uint32_t size = 0;
    const absl::Time deadline = absl::Now() + kLongWait;
    if (!ReadAll(reply_fd_, &size, sizeof(size), deadline) || size > (1u << 20)) {
      return absl::UnavailableError("target sent no descriptor");
    }
    std::string blob(size, '\0');
    if (!ReadAll(reply_fd_, blob.data(), size, deadline)) {
      return absl::UnavailableError("target's descriptor truncated");
    }
    return ParseDescriptor(blob);
  }
  absl::StatusOr<uint64_t> Checksum() {
    uint64_t h = 0;
    if (!WriteAll(cmd_fd_, "C", 1) || !ReadAll(reply_fd_, &h, sizeof(h), absl::Now() + kLongWait)) {
      return absl::UnavailableError("target did not answer");
    }
    return h;
  }
  bool SetPaused(bool paused) {
    char ack;
    return WriteAll(cmd_fd_, paused ? "P" : "R", 1) &&
           ReadAll(reply_fd_, &ack, 1, absl::Now() + kLongWait);
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  TargetProcess(pid_t pid, int cmd_fd, int reply_fd)
      : pid_(pid), cmd_fd_(cmd_fd), reply_fd_(reply_fd) {}
  pid_t pid_;
  const int cmd_fd_, reply_fd_;
};

struct Setup {
  std::string name;
  Config config;
  bool peer_errors;
};

void PrintTo(const Setup& s, std::ostream* os) { *os << s.name; }

class UcxTwoProcessTest : public ::testing::TestWithParam<Setup> {
 protected:
  void SetUp() override {
    // Fork first: the child must not inherit threads (UCX's, or our progress thread).
    target_ = TargetProcess::Start("decode-0", GetParam().config, GetParam().peer_errors);
    ASSERT_NE(target_, nullptr);
    auto w = NewUcxTransport(Options("prefill-0", GetParam().config, GetParam().peer_errors));
    ASSERT_TRUE(w.ok()) << w.status();
    writer_ = *std::move(w);
    source_.resize(kBytes);
    for (size_t i = 0; i < kBytes; ++i)
      source_[i] = static_cast<uint8_t>((i * 7 + i / 8191) & 0xff);
    auto reg = writer_->Register({source_.data(), source_.size()}, {/*remote_write=*/false});
    ASSERT_TRUE(reg.ok()) << reg.status();
    source_reg_ = *std::move(reg);
    auto d = target_->Descriptor();
    ASSERT_TRUE(d.ok()) << d.status();
    descriptor_ = *d;
    auto r = writer_->Connect(descriptor_);
    ASSERT_TRUE(r.ok()) << r.status();
    remote_ = *std::move(r);
  }
  void TearDown() override {
    remote_.reset();
    source_reg_.reset();
    writer_.reset();
    target_.reset();
  }

  std::unique_ptr<TargetProcess> target_;
  std::unique_ptr<UcxTransport> writer_;
  std::vector<uint8_t> source_;
  std::unique_ptr<Registration> source_reg_;
  std::unique_ptr<RemoteTarget> remote_;
  PeerDescriptor descriptor_;
};

TEST_P(UcxTwoProcessTest, EveryByteLandsInTheOtherProcess) {
  // Source page i goes to target page (i * 37) % kPages: scattered, with a contiguous head run.
  std::vector<BlockCopy> copies;
  std::vector<uint8_t> expect(kBytes, 0);
  for (size_t i = 0; i < kPages; ++i) {
    const size_t dst = i < 64 ? i : (i * 37) % (kPages - 64) + 64;
    copies.push_back({descriptor_.base_address + dst * kPage, source_.data() + i * kPage, kPage});
  }
  for (const BlockCopy& c : copies) {
    std::memcpy(expect.data() + (c.remote_addr - descriptor_.base_address), c.local_addr, c.length);
  }
  auto h = writer_->Write(*remote_, copies);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*h)->Wait(kLongWait).ok());
  auto sum = target_->Checksum();
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(*sum, Fnv1a(expect.data(), expect.size()));
  auto lanes = writer_->DescribeEndpoint(*remote_);
  ASSERT_TRUE(lanes.ok());
  RecordProperty("endpoint", *lanes);
}

TEST_P(UcxTwoProcessTest, KilledPeerFailsTheBatchInFlightWithUnavailable) {
  if (!GetParam().peer_errors) {
    GTEST_SKIP() << "no peer failure handling on UCX 1.13 shared memory: a dead peer is noticed "
                    "only by the caller's deadline";
  }
  auto warm = writer_->Write(*remote_, {{descriptor_.base_address, source_.data(), kPage}});
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE((*warm)->Wait(kLongWait).ok());
  ASSERT_TRUE(target_->SetPaused(true));
  auto h = writer_->Write(*remote_, {{descriptor_.base_address, source_.data(), 16 * kPage}});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ((*h)->Wait(absl::Milliseconds(100)).code(), absl::StatusCode::kDeadlineExceeded);
  target_->Kill();
  const absl::Time start = absl::Now();
  absl::Status s = (*h)->Wait(kLongWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  auto again = writer_->Write(*remote_, {{descriptor_.base_address, source_.data(), 64}});
  absl::Status again_status = again.ok() ? (*again)->Wait(kLongWait) : again.status();
  EXPECT_EQ(again_status.code(), absl::StatusCode::kUnavailable) << again_status;
}

TEST_P(UcxTwoProcessTest, RestartedPeerGetsAFreshConnectionAndTheOldDescriptorIsRefused) {
  if (!GetParam().peer_errors) GTEST_SKIP() << "needs peer failure handling (see above)";
  target_->Kill();
  // Let the writer notice (a write to the dead peer fails), then "restart" the target.
  absl::Status dead = absl::OkStatus();
  const absl::Time deadline = absl::Now() + kLongWait;
  while (dead.ok() && absl::Now() < deadline) {
    auto h = writer_->Write(*remote_, {{descriptor_.base_address, source_.data(), 64}});
    dead = h.ok() ? (*h)->Wait(kLongWait) : h.status();
  }
  ASSERT_EQ(dead.code(), absl::StatusCode::kUnavailable) << dead;
  EXPECT_EQ(writer_->Connect(descriptor_).status().code(), absl::StatusCode::kUnavailable);

  // The restarted peer: a new UCX worker (new address) under the same node name. It runs in this
  // process because forking is unsafe once this process has threads; what is under test is the
  // writer's side, which must build a fresh endpoint and never reuse the dead one.
  auto restarted = NewUcxTransport(Options("decode-0", GetParam().config, GetParam().peer_errors));
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  std::vector<uint8_t> memory(kBytes, 0);
  auto reg = (*restarted)->Register({memory.data(), memory.size()});
  ASSERT_TRUE(reg.ok());
  auto fresh = writer_->Connect(*(*reg)->Describe());
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto h = writer_->Write(**fresh,
                          {{reinterpret_cast<uintptr_t>(memory.data()), source_.data(), kPage}});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*h)->Wait(kLongWait).ok());
  EXPECT_EQ(0, std::memcmp(memory.data(), source_.data(), kPage));
  fresh->reset();
  // Objects of `restarted` go before it; the writer's target into it is already gone.
  remote_.reset();
  source_reg_.reset();
  writer_.reset();
  reg->reset();
}

INSTANTIATE_TEST_SUITE_P(
    All, UcxTwoProcessTest,
    ::testing::Values(Setup{"Tcp", {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}}, true},
                      Setup{"Shm", {{"TLS", "sm,self"}}, false}),
    [](const ::testing::TestParamInfo<Setup>& info) { return info.param.name; });

}  // namespace
}  // namespace fluxion::transfer
