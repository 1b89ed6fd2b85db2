// UCX between two processes, the way prefill and decode nodes use it: the test process is the
// writer (prefill side); a forked child owns the registered memory (decode side), sends its
// descriptors over a pipe and answers commands (checksum its memory, pause or resume its progress,
// revoke a registration). The child is forked before this process starts any thread or UCX object,
// and every read from it has a deadline. Covers what one process cannot: CMA/shared memory between
// address spaces, a peer killed with SIGKILL while a batch is in flight, and hostile descriptors
// (widened, beyond the arena, stale) aimed at another process: it survives, and its memory
// outside the live registration is untouched.
#include <fcntl.h>
#include <sys/mman.h>
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
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transfer/descriptor_check.h"
#include "transfer/transport.h"
#include "transfer/transport_testing.h"
#include "transfer/ucx_transport.h"

namespace fluxion::transfer {
namespace {

constexpr size_t kPage = 8192;
constexpr size_t kPages = 256;  // 2 MiB
constexpr size_t kBytes = kPage * kPages;
// The child's second registration, a "reservation run" in the middle of its memory.
constexpr size_t kRunOffset = kBytes / 4;
constexpr size_t kRunBytes = kBytes / 2;
// A mapping of the child's with no access at all: a write there would kill it.
constexpr size_t kGuardBytes = 1 << 20;
constexpr absl::Duration kLongWait = absl::Seconds(10);

using ::testing::HasSubstr;

using Config = std::vector<std::pair<std::string, std::string>>;

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

bool SendBlob(int fd, const std::string& blob) {
  const uint32_t size = static_cast<uint32_t>(blob.size());
  return WriteAll(fd, &size, sizeof(size)) && WriteAll(fd, blob.data(), size);
}

// The child: owns the target memory. Sends the descriptor of all of it, the descriptor of a run
// in its middle, and the address of an inaccessible mapping; exits when told to, or when the
// parent goes silent.
[[noreturn]] void RunTarget(int cmd_fd, int reply_fd, const std::string& node, const Config& config,
                            bool peer_errors) {
  auto transport = NewUcxTransport(Options(node, config, peer_errors));
  if (!transport.ok()) _exit(2);
  std::vector<uint8_t> memory(kBytes, 0);
  auto reg = (*transport)->Register({memory.data(), memory.size()});
  auto run = (*transport)->Register({memory.data() + kRunOffset, kRunBytes});
  void* guard =
      mmap(nullptr, kGuardBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (!reg.ok() || !run.ok() || guard == MAP_FAILED) _exit(3);
  const uint64_t guard_addr = reinterpret_cast<uintptr_t>(guard);
  if (!SendBlob(reply_fd, SerializeDescriptor(*(*reg)->Describe())) ||
      !SendBlob(reply_fd, SerializeDescriptor(*(*run)->Describe())) ||
      !WriteAll(reply_fd, &guard_addr, sizeof(guard_addr))) {
    _exit(4);
  }
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
    } else if (cmd == 'D') {  // the run's reservation ended: revoke its key
      run->reset();
      WriteAll(reply_fd, "k", 1);
    }
  }
  run->reset();
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

  // The child's descriptors, in the order it sends them (all of its memory, then the run).
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
  absl::StatusOr<uint64_t> GuardAddress() {
    uint64_t addr = 0;
    if (!ReadAll(reply_fd_, &addr, sizeof(addr), absl::Now() + kLongWait)) {
      return absl::UnavailableError("target sent no guard address");
    }
    return addr;
  }
  bool RevokeRun() {
    char ack;
    return WriteAll(cmd_fd_, "D", 1) && ReadAll(reply_fd_, &ack, 1, absl::Now() + kLongWait);
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
    auto run = target_->Descriptor();
    ASSERT_TRUE(run.ok()) << run.status();
    run_ = *run;
    auto guard = target_->GuardAddress();
    ASSERT_TRUE(guard.ok()) << guard.status();
    guard_ = *guard;
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
  PeerDescriptor descriptor_;  // all of the child's memory
  PeerDescriptor run_;         // the run in its middle
  uint64_t guard_ = 0;         // the child's inaccessible mapping
};

// `d` with its key re-wrapped for [base, base + length) and that range advertised (the envelope's
// CRC is no secret): the writer's own checks all pass for it.
PeerDescriptor Widened(const PeerDescriptor& d, uint64_t base, uint64_t length) {
  absl::StatusOr<UnwrappedBlob> key = UnwrapBlob(BlobField::kRemoteKey, d.remote_key, 4096);
  EXPECT_TRUE(key.ok()) << key.status();
  PeerDescriptor forged = d;
  forged.remote_key = WrapBlob(BlobField::kRemoteKey, key.ok() ? key->payload : "", base, length);
  forged.base_address = base;
  forged.length = length;
  return forged;
}

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

// The run's key widened to all of the child's memory, and to its inaccessible mapping: every
// write outside the run is refused by the child before it touches memory, the batches fail with
// FailedPrecondition, the child survives (it answers, and an honest write through the run still
// lands), and not one byte outside the run changed. (Before target-checked landings the first
// wrote over the child's memory and the second killed it with SIGSEGV inside UCX.)
TEST_P(UcxTwoProcessTest, ForgedAndOutOfArenaWritesLeaveTheTargetIntact) {
  const std::vector<uint8_t> zeros(kBytes, 0);
  auto before = target_->Checksum();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(*before, Fnv1a(zeros.data(), zeros.size()));
  const uint64_t base = descriptor_.base_address;
  struct Attack {
    PeerDescriptor forged;
    std::vector<BlockCopy> copies;
  };
  const std::vector<Attack> attacks = {
      {Widened(run_, base, kBytes),
       {{base, source_.data(), kPage},                                    // before the run
        {base + kRunOffset + kRunBytes - kPage, source_.data(), 2 * kPage},  // across its end
        {base + kBytes - 64 * kPage, source_.data(), 64 * kPage}}},       // after it, large
      {Widened(run_, guard_, kGuardBytes),
       {{guard_, source_.data(), kPage}, {guard_ + kGuardBytes - kPage, source_.data(), kPage}}},
  };
  for (const Attack& a : attacks) {
    auto t = writer_->Connect(a.forged);
    ASSERT_TRUE(t.ok()) << t.status();  // the descriptor is well-formed: only the target can tell
    auto h = writer_->Write(**t, a.copies);
    ASSERT_TRUE(h.ok()) << h.status();
    absl::Status s = (*h)->Wait(kLongWait);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("outside the landing")) << s;
    t->reset();
  }
  auto after = target_->Checksum();
  ASSERT_TRUE(after.ok()) << "the target process died: " << after.status();
  EXPECT_EQ(*after, *before) << "memory outside the run changed";
  // Still serving: an honest write through the run's own descriptor lands.
  auto honest = writer_->Connect(run_);
  ASSERT_TRUE(honest.ok()) << honest.status();
  auto h = writer_->Write(**honest, {{run_.base_address, source_.data(), 4 * kPage}});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*h)->Wait(kLongWait).ok());
  std::vector<uint8_t> expect(kBytes, 0);
  std::memcpy(expect.data() + kRunOffset, source_.data(), 4 * kPage);
  auto landed = target_->Checksum();
  ASSERT_TRUE(landed.ok()) << landed.status();
  EXPECT_EQ(*landed, Fnv1a(expect.data(), expect.size()));
  honest->reset();
}

// The run's registration destroyed in the child (its reservation ended) while this process holds
// its descriptor: a write through it lands nothing and fails naming the revocation.
TEST_P(UcxTwoProcessTest, StaleDescriptorLandsNothing) {
  auto run = writer_->Connect(run_);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(target_->RevokeRun());
  auto h = writer_->Write(**run, {{run_.base_address, source_.data(), 8 * kPage}});
  ASSERT_TRUE(h.ok()) << h.status();
  absl::Status s = (*h)->Wait(kLongWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("revoked")) << s;
  const std::vector<uint8_t> zeros(kBytes, 0);
  auto sum = target_->Checksum();
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(*sum, Fnv1a(zeros.data(), zeros.size()));
  run->reset();
}

INSTANTIATE_TEST_SUITE_P(
    All, UcxTwoProcessTest,
    ::testing::Values(Setup{"Tcp", {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}}, true},
                      Setup{"Shm", {{"TLS", "sm,self"}}, false}),
    [](const ::testing::TestParamInfo<Setup>& info) { return info.param.name; });

}  // namespace
}  // namespace fluxion::transfer
