// One body of behaviour tests run against every Transport (NIXL's TEST_P pattern): Loopback
// always, and UCX where it was built, in two configurations: TCP over the loopback device and
// shared memory. The writer and the target are two transports in this process (each UCX one with
// its own context, worker and progress thread), so the UCX cases cross a real UCX wire, and a
// target can be paused or destroyed at a chosen moment; transfer/ucx_two_process_test.cc repeats
// the essentials across two processes.
//
// The target's side of the contract is tested here too, on every transport: a forged descriptor
// (a real key re-wrapped with a wider scope), a range beyond any mapped memory and a stale
// descriptor (its registration destroyed) all fail the batch cleanly, nothing lands outside a
// live registration, and the target keeps serving.
//
// Every wait has a deadline; nothing binds outside 127.0.0.1; no environment is read (UCX is
// configured through UcxOptions::config).
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transfer/descriptor_check.h"
#include "transfer/loopback_transport.h"
#include "transfer/transport.h"
#include "transfer/transport_testing.h"
#ifdef FLUXION_TRANSFER_CONFORMANCE_UCX
#include "transfer/ucx_transport.h"
#endif

namespace fluxion::transfer {
namespace {

using ::testing::HasSubstr;

constexpr size_t kPage = 8192;  // one bf16 KV page at 16 tokens, head_dim 128
constexpr size_t kPages = 128;  // 1 MiB per buffer
constexpr size_t kBytes = kPage * kPages;
constexpr absl::Duration kLongWait = absl::Seconds(10);

// True once Poll() reports the batch landed.
bool Landed(TransferHandle& h) {
  absl::StatusOr<bool> r = h.Poll();
  return r.ok() && *r;
}

// How to make and steer one kind of transport.
struct Backend {
  std::string name;
  std::function<absl::StatusOr<std::unique_ptr<Transport>>(const std::string& node)> make;
  std::function<void(Transport*, bool)> pause;
  // Whether the death of a peer is visible to this transport (UCX: peer error handling on, which
  // UCX 1.13 supports only over TCP here).
  bool detects_peer_death = true;
};

#ifndef FLUXION_TRANSFER_CONFORMANCE_UCX
Backend LoopbackBackend() {
  return Backend{"Loopback",
                 [](const std::string& node) -> absl::StatusOr<std::unique_ptr<Transport>> {
                   return std::unique_ptr<Transport>(new LoopbackTransport({node, TestCompat()}));
                 },
                 [](Transport* t, bool paused) {
                   static_cast<LoopbackTransport*>(t)->SetProgressPausedForTesting(paused);
                 },
                 true};
}
#endif

#ifdef FLUXION_TRANSFER_CONFORMANCE_UCX
Backend UcxBackend(std::string name, std::vector<std::pair<std::string, std::string>> config,
                   bool peer_error_handling) {
  return Backend{std::move(name),
                 [config, peer_error_handling](
                     const std::string& node) -> absl::StatusOr<std::unique_ptr<Transport>> {
                   UcxOptions options;
                   options.peer_error_handling = peer_error_handling;
                   options.node_name = node;
                   options.compat = TestCompat();
                   options.config = config;
                   absl::StatusOr<std::unique_ptr<UcxTransport>> t = NewUcxTransport(options);
                   if (!t.ok()) return t.status();
                   return std::unique_ptr<Transport>(std::move(*t));
                 },
                 [](Transport* t, bool paused) {
                   static_cast<UcxTransport*>(t)->SetProgressPausedForTesting(paused);
                 },
                 peer_error_handling};
}
#endif

// This file builds twice (transfer/CMakeLists.txt): into transfer_test over Loopback (label unit)
// and, with FLUXION_TRANSFER_CONFORMANCE_UCX, into transfer_ucx_test over UCX (label integration).
std::vector<Backend> AllBackends() {
#ifdef FLUXION_TRANSFER_CONFORMANCE_UCX
  return {
      // TCP on the loopback device only: nothing external is bound.
      UcxBackend("UcxTcp", {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}}, true),
      // Shared memory (posix/sysv mappings for active messages, CMA for zero-copy) plus self.
      // UCX 1.13 has no peer failure handling on these transports, so it must be off.
      UcxBackend("UcxShm", {{"TLS", "sm,self"}}, /*peer_error_handling=*/false),
  };
#else
  return {LoopbackBackend()};
#endif
}

void PrintTo(const Backend& b, std::ostream* os) { *os << b.name; }

class TransportConformanceTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Transport>> w = GetParam().make("prefill-0");
    if (!w.ok() && absl::IsUnavailable(w.status())) {
      GTEST_SKIP() << GetParam().name << " unavailable here: " << w.status();
    }
    ASSERT_TRUE(w.ok()) << w.status();
    writer_ = *std::move(w);
    absl::StatusOr<std::unique_ptr<Transport>> t = GetParam().make("decode-0");
    ASSERT_TRUE(t.ok()) << t.status();
    target_ = *std::move(t);

    source_.resize(kBytes);
    for (size_t i = 0; i < kBytes; ++i)
      source_[i] = static_cast<uint8_t>((i * 131 + i / kPage) & 0xff);
    arena_.assign(kBytes, 0);

    auto src = writer_->Register({source_.data(), source_.size()}, {/*remote_write=*/false});
    ASSERT_TRUE(src.ok()) << src.status();
    source_reg_ = *std::move(src);
    auto dst = target_->Register({arena_.data(), arena_.size()});
    ASSERT_TRUE(dst.ok()) << dst.status();
    arena_reg_ = *std::move(dst);
    auto desc = arena_reg_->Describe();
    ASSERT_TRUE(desc.ok()) << desc.status();
    descriptor_ = *std::move(desc);
  }

  void TearDown() override {
    // Objects before their transports (transport.h); writer first so nothing writes into a
    // destroyed target.
    remote_.reset();
    source_reg_.reset();
    writer_.reset();
    arena_reg_.reset();
    target_.reset();
  }

  void ConnectOrDie() {
    auto r = writer_->Connect(descriptor_);
    ASSERT_TRUE(r.ok()) << r.status();
    remote_ = *std::move(r);
  }

  uint64_t ArenaAddr(size_t page) const {
    return reinterpret_cast<uintptr_t>(arena_.data()) + page * kPage;
  }
  const uint8_t* SourcePage(size_t page) const { return source_.data() + page * kPage; }

  void DestroyTarget() {
    arena_reg_.reset();
    target_.reset();
  }

  std::unique_ptr<Transport> writer_, target_;
  std::vector<uint8_t> source_, arena_;
  std::unique_ptr<Registration> source_reg_, arena_reg_;
  std::unique_ptr<RemoteTarget> remote_;
  PeerDescriptor descriptor_;
};

TEST_P(TransportConformanceTest, WriteLandsEveryByteOfContiguousAndScatteredBlocks) {
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  // Pages 0..31 go to arena pages 0..31 (one contiguous run); the rest go to a shuffled set of
  // the remaining arena pages (scattered). Source page 100 is left out: its arena slot stays 0.
  std::vector<size_t> dst(kPages - 32);
  std::iota(dst.begin(), dst.end(), 32);
  std::shuffle(dst.begin(), dst.end(), std::mt19937(7));
  std::vector<BlockCopy> copies;
  std::vector<size_t> expect_src(kPages, SIZE_MAX);
  for (size_t p = 0; p < 32; ++p) {
    copies.push_back({ArenaAddr(p), SourcePage(p), kPage});
    expect_src[p] = p;
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    const size_t src_page = 32 + i;
    if (src_page == 100) continue;
    copies.push_back({ArenaAddr(dst[i]), SourcePage(src_page), kPage});
    expect_src[dst[i]] = src_page;
  }
  // A few sub-page copies as well (odd lengths and offsets).
  copies.push_back({ArenaAddr(dst[100 - 32]) + 17, SourcePage(5) + 3, 1000});
  expect_src[dst[100 - 32]] = SIZE_MAX - 1;

  auto handle = writer_->Write(*remote_, copies);
  ASSERT_TRUE(handle.ok()) << handle.status();
  ASSERT_TRUE((*handle)->Wait(kLongWait).ok());
  EXPECT_TRUE(Landed(**handle));

  for (size_t page = 0; page < kPages; ++page) {
    const uint8_t* got = arena_.data() + page * kPage;
    if (expect_src[page] == SIZE_MAX - 1) {
      std::vector<uint8_t> want(kPage, 0);
      std::memcpy(want.data() + 17, SourcePage(5) + 3, 1000);
      ASSERT_EQ(0, std::memcmp(got, want.data(), kPage)) << "page " << page;
    } else {
      ASSERT_NE(expect_src[page], SIZE_MAX) << "every arena page has a writer";
      ASSERT_EQ(0, std::memcmp(got, SourcePage(expect_src[page]), kPage)) << "page " << page;
    }
  }
  const TransportMetrics m = writer_->metrics();
  EXPECT_EQ(m.copies_submitted, copies.size());
  EXPECT_LT(m.ops_issued, copies.size());  // the contiguous run was merged
  EXPECT_EQ(m.batches_completed, 1u);
  EXPECT_EQ(m.bytes_written, 32 * kPage + (dst.size() - 1) * kPage + 1000);
}

TEST_P(TransportConformanceTest, ContiguousRunBecomesOnePutUnlessCoalescingIsOff) {
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  std::vector<BlockCopy> copies;
  for (size_t p = 0; p < 64; ++p) copies.push_back({ArenaAddr(p), SourcePage(p), kPage});

  auto merged = writer_->Write(*remote_, copies);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_TRUE((*merged)->Wait(kLongWait).ok());
  EXPECT_EQ(writer_->metrics().ops_issued, 1u);

  std::fill(arena_.begin(), arena_.end(), 0);
  auto separate = writer_->Write(*remote_, copies, WriteOptions{/*coalesce=*/false});
  ASSERT_TRUE(separate.ok()) << separate.status();
  ASSERT_TRUE((*separate)->Wait(kLongWait).ok());
  EXPECT_EQ(writer_->metrics().ops_issued, 1u + 64u);
  EXPECT_EQ(0, std::memcmp(arena_.data(), source_.data(), 64 * kPage));
}

TEST_P(TransportConformanceTest, WriteOutsideRemoteRangeIsRejectedAndNothingLands) {
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  const uint64_t base = ArenaAddr(0);
  const std::vector<std::vector<BlockCopy>> bad = {
      // A good copy, then one running 1 byte past the end.
      {{base, SourcePage(0), kPage}, {base + kBytes - kPage + 1, SourcePage(1), kPage}},
      // Starting before the base.
      {{base - 1, SourcePage(0), 16}},
      // Wrapping around the address space.
      {{UINT64_MAX - 8, SourcePage(0), 64}},
      // Empty.
      {{base, SourcePage(0), 0}},
  };
  for (const auto& copies : bad) {
    auto h = writer_->Write(*remote_, copies);
    EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  }
  EXPECT_THAT(writer_->Write(*remote_, bad[0]).status().message(), HasSubstr("copy 1 of 2"));
  EXPECT_TRUE(std::all_of(arena_.begin(), arena_.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_GE(writer_->metrics().failed_invalid_argument, bad.size());
}

TEST_P(TransportConformanceTest, WriteFromUnregisteredLocalMemoryIsRejected) {
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  std::vector<uint8_t> stray(kPage, 1);
  auto h = writer_->Write(*remote_, {{ArenaAddr(0), stray.data(), kPage}});
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(h.status().message(), HasSubstr("no registration"));
  // Straddling the end of the source registration.
  auto h2 = writer_->Write(*remote_, {{ArenaAddr(0), source_.data() + kBytes - 10, 20}});
  EXPECT_EQ(h2.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(TransportConformanceTest, NarrowedRegistrationOnlyAcceptsWritesInsideIt) {
  // A second, narrower registration inside the arena: the shape of a per-reservation key.
  auto narrow = target_->Register({arena_.data() + 16 * kPage, 8 * kPage});
  ASSERT_TRUE(narrow.ok()) << narrow.status();
  auto desc = (*narrow)->Describe();
  ASSERT_TRUE(desc.ok());
  EXPECT_EQ(desc->length, 8 * kPage);
  auto target = writer_->Connect(*desc);
  ASSERT_TRUE(target.ok()) << target.status();

  auto inside = writer_->Write(**target, {{ArenaAddr(16), SourcePage(3), 8 * kPage}});
  ASSERT_TRUE(inside.ok()) << inside.status();
  ASSERT_TRUE((*inside)->Wait(kLongWait).ok());
  EXPECT_EQ(0, std::memcmp(arena_.data() + 16 * kPage, SourcePage(3), 8 * kPage));

  auto outside = writer_->Write(**target, {{ArenaAddr(15), SourcePage(3), kPage}});
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  auto past = writer_->Write(**target, {{ArenaAddr(23), SourcePage(3), 2 * kPage}});
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  target->reset();
  narrow->reset();
}

TEST_P(TransportConformanceTest, IncompatiblePeerIsRejectedNamingTheField) {
  struct Case {
    const char* field;
    std::function<void(CompatibilityRecord&)> change;
  };
  const std::vector<Case> cases = {
      {"protocol_version", [](CompatibilityRecord& c) { c.protocol_version = 2; }},
      {"model_id", [](CompatibilityRecord& c) { c.model_id = "sha256:other"; }},
      {"kv_dtype", [](CompatibilityRecord& c) { c.kv_dtype = 1; }},
      {"num_layers", [](CompatibilityRecord& c) { c.num_layers = 32; }},
      {"num_kv_heads", [](CompatibilityRecord& c) { c.num_kv_heads = 8; }},
      {"head_dim", [](CompatibilityRecord& c) { c.head_dim = 64; }},
      {"page_tokens", [](CompatibilityRecord& c) { c.page_tokens = 32; }},
      {"layout_version", [](CompatibilityRecord& c) { c.layout_version = 2; }},
  };
  for (const Case& c : cases) {
    PeerDescriptor d = descriptor_;
    c.change(d.compat);
    auto r = writer_->Connect(d);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << c.field;
    EXPECT_THAT(r.status().message(), HasSubstr(c.field));
    EXPECT_THAT(r.status().message(), HasSubstr("decode-0"));
  }
  EXPECT_EQ(writer_->metrics().failed_incompatible, cases.size());

  // The same through a real peer configured differently.
  absl::StatusOr<std::unique_ptr<Transport>> other = GetParam().make("decode-1");
  ASSERT_TRUE(other.ok());
  // (Its compat comes from TestCompat(); the descriptor is what travels, so we alter it there.)
  std::vector<uint8_t> buf(kPage);
  auto reg = (*other)->Register({buf.data(), buf.size()});
  ASSERT_TRUE(reg.ok());
  PeerDescriptor d = *(*reg)->Describe();
  d.compat.num_kv_heads = 4;
  EXPECT_THAT(writer_->Connect(ParseDescriptor(SerializeDescriptor(d)).value()).status().message(),
              HasSubstr("num_kv_heads is 2 here, 4 at peer"));
  reg->reset();
}

TEST_P(TransportConformanceTest, DescriptorOfAnotherTransportKindIsRejected) {
  PeerDescriptor d = descriptor_;
  d.transport = d.transport == "ucx" ? "loopback" : "ucx";
  EXPECT_EQ(writer_->Connect(d).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(TransportConformanceTest, SerializedDescriptorConnectsAndWrites) {
  const std::string blob = SerializeDescriptor(descriptor_);
  auto parsed = ParseDescriptor(blob);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  auto target = writer_->Connect(*parsed);
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ((*target)->peer_name(), "decode-0");
  auto h = writer_->Write(**target, {{ArenaAddr(5), SourcePage(9), kPage}});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*h)->Wait(kLongWait).ok());
  EXPECT_EQ(0, std::memcmp(arena_.data() + 5 * kPage, SourcePage(9), kPage));
  target->reset();
}

TEST_P(TransportConformanceTest, RegistrationWithoutRemoteWriteCannotBeDescribed) {
  EXPECT_EQ(source_reg_->Describe().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(TransportConformanceTest, WaitPastDeadlineReturnsDeadlineExceededWithoutCancelling) {
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  // Make sure the connection is up before pausing (wireup needs the target's progress too).
  auto warm = writer_->Write(*remote_, {{ArenaAddr(0), SourcePage(0), 64}});
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE((*warm)->Wait(kLongWait).ok());

  GetParam().pause(target_.get(), true);
  auto h = writer_->Write(*remote_, {{ArenaAddr(1), SourcePage(1), 256}});
  ASSERT_TRUE(h.ok()) << h.status();
  const absl::Time start = absl::Now();
  EXPECT_EQ((*h)->Wait(absl::Milliseconds(200)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  EXPECT_FALSE(Landed(**h));
  EXPECT_TRUE((*h)->Poll().ok());
  EXPECT_EQ(writer_->Flush(absl::Milliseconds(50)).code(), absl::StatusCode::kDeadlineExceeded);

  GetParam().pause(target_.get(), false);
  ASSERT_TRUE((*h)->Wait(kLongWait).ok());
  EXPECT_EQ(0, std::memcmp(arena_.data() + kPage, SourcePage(1), 256));
  EXPECT_GE(writer_->metrics().failed_deadline, 2u);
}

TEST_P(TransportConformanceTest, PeerDestroyedBeforeWaitGivesUnavailableNotAHang) {
  if (!GetParam().detects_peer_death) {
    GTEST_SKIP() << GetParam().name
                 << ": no peer failure handling on this transport (UCX 1.13 shared memory)";
  }
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  auto warm = writer_->Write(*remote_, {{ArenaAddr(0), SourcePage(0), 64}});
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE((*warm)->Wait(kLongWait).ok());

  GetParam().pause(target_.get(), true);
  auto h = writer_->Write(*remote_, {{ArenaAddr(1), SourcePage(1), 4 * kPage}});
  ASSERT_TRUE(h.ok()) << h.status();
  DestroyTarget();
  // Not a hang: a wait that only ended at its deadline would say kDeadlineExceeded.
  absl::Status s = (*h)->Wait(kLongWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;

  // Once known dead, the peer is refused at once, and so is its stale descriptor.
  const absl::Time later = absl::Now();
  absl::Status again = absl::OkStatus();
  while (again.ok() && absl::Now() - later < kLongWait) {
    auto h2 = writer_->Write(*remote_, {{ArenaAddr(2), SourcePage(2), 64}});
    again = h2.ok() ? (*h2)->Wait(kLongWait) : h2.status();
  }
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  EXPECT_EQ(writer_->Connect(descriptor_).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_GE(writer_->metrics().failed_unavailable, 2u);
}

TEST_P(TransportConformanceTest, WriterDestroyedWithBatchInFlightCompletesItsHandle) {
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  auto warm = writer_->Write(*remote_, {{ArenaAddr(0), SourcePage(0), 64}});
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE((*warm)->Wait(kLongWait).ok());
  GetParam().pause(target_.get(), true);
  auto h = writer_->Write(*remote_, {{ArenaAddr(1), SourcePage(1), 256}});
  ASSERT_TRUE(h.ok());
  remote_.reset();
  source_reg_.reset();
  writer_.reset();
  // The handle outlives its transport and reports the batch as not known to have landed.
  absl::Status s = (*h)->Wait(kLongWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  GetParam().pause(target_.get(), false);
}

TEST_P(TransportConformanceTest, FlushWaitsForEveryBatch) {
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  std::vector<std::unique_ptr<TransferHandle>> handles;
  for (size_t p = 0; p < 16; ++p) {
    auto h = writer_->Write(*remote_, {{ArenaAddr(p * 2), SourcePage(p), kPage}});
    ASSERT_TRUE(h.ok());
    handles.push_back(*std::move(h));
  }
  ASSERT_TRUE(writer_->Flush(kLongWait).ok());
  for (auto& h : handles) EXPECT_TRUE(Landed(*h));
  for (size_t p = 0; p < 16; ++p) {
    EXPECT_EQ(0, std::memcmp(arena_.data() + p * 2 * kPage, SourcePage(p), kPage));
  }
  const TransportMetrics m = writer_->metrics();
  uint64_t counted = 0;
  for (uint64_t c : m.latency_buckets) counted += c;
  EXPECT_EQ(counted, m.batches_completed);
  EXPECT_EQ(m.batches_completed, 16u);
}

TEST_P(TransportConformanceTest, ConcurrentWritersFromManyThreadsAllLand) {
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (size_t p = t; p < kPages; p += kThreads) {
        auto h = writer_->Write(*remote_, {{ArenaAddr(p), SourcePage(p), kPage}});
        if (!h.ok()) {
          results[t] = h.status();
          return;
        }
        if (absl::Status s = (*h)->Wait(kLongWait); !s.ok()) {
          results[t] = s;
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r;
  EXPECT_EQ(0, std::memcmp(arena_.data(), source_.data(), kBytes));
}

// Every single-byte flip, every truncation and a few extensions of the descriptor's enveloped
// worker address and remote key: InvalidArgument naming the field, before the transport library
// sees a byte. (Before the envelope and the UCX structure checks, flipping byte 0 of a UCX worker
// address aborted the process inside ucp_address_unpack.)
TEST_P(TransportConformanceTest, CorruptedBlobsAreRefusedWithInvalidArgumentNamingTheField) {
  struct Field {
    const char* name;
    std::string PeerDescriptor::*member;
  };
  for (const Field& f : {Field{"worker_address", &PeerDescriptor::worker_address},
                         Field{"remote_key", &PeerDescriptor::remote_key}}) {
    const std::string good = descriptor_.*f.member;
    std::vector<std::string> bad;
    for (size_t i = 0; i < good.size(); ++i) {
      for (uint8_t bit : {0x01, 0x80}) {
        std::string b = good;
        b[i] = static_cast<char>(b[i] ^ bit);
        bad.push_back(b);
      }
    }
    for (size_t n = 0; n < good.size(); ++n) bad.push_back(good.substr(0, n));
    for (size_t extra : {1, 7, 64}) bad.push_back(good + std::string(extra, '\x5a'));
    for (const std::string& b : bad) {
      PeerDescriptor d = descriptor_;
      d.*f.member = b;
      auto r = writer_->Connect(d);
      ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
          << f.name << " of " << b.size() << " bytes: " << r.status();
      ASSERT_THAT(r.status().message(), HasSubstr(f.name)) << r.status();
    }
  }
  // Worker address and key swapped.
  PeerDescriptor swapped = descriptor_;
  std::swap(swapped.worker_address, swapped.remote_key);
  EXPECT_EQ(writer_->Connect(swapped).status().code(), absl::StatusCode::kInvalidArgument);
  // The real descriptor still connects afterwards.
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());
}

// Base addresses no registration can have, lengths that overflow, and a range the key was not
// issued for: refused before anything touches the peer (a base of 0x1000 made the decode node
// segfault serving Connect's probe read).
TEST_P(TransportConformanceTest, ImplausibleRangesAreRefusedBeforeTouchingThePeer) {
  struct Case {
    uint64_t base, length;
    const char* expect;
  };
  const uint64_t real = descriptor_.base_address;
  const std::vector<Case> cases = {
      {0x1000, kPage, "base_address"},
      {0, kPage, "base_address"},
      {real, 0, "length is 0"},
      {real + 3, kPage, "aligned"},
      {0xffff800000000000ull, kPage, "user address space"},  // kernel half
      {uint64_t{1} << 47, kPage, "user address space"},      // non-canonical
      {real, UINT64_MAX - 8, "user address space"},          // wraps
      {real - kPage, kPage, "remote_key was issued for"},    // just before the registration
      {real, kBytes + 8, "remote_key was issued for"},       // one word past its end
  };
  for (const Case& c : cases) {
    PeerDescriptor d = descriptor_;
    d.base_address = c.base;
    d.length = c.length;
    auto r = writer_->Connect(d);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << std::hex << c.base;
    EXPECT_THAT(r.status().message(), HasSubstr(c.expect)) << r.status();
  }
  PeerDescriptor no_name = descriptor_;
  no_name.peer_name.clear();
  EXPECT_EQ(writer_->Connect(no_name).status().code(), absl::StatusCode::kInvalidArgument);
  // A sub-range of the key's scope is fine (the services pass fewer bytes than registered).
  PeerDescriptor inner = descriptor_;
  inner.base_address += kPage;
  inner.length = kPage;
  auto r = writer_->Connect(inner);
  ASSERT_TRUE(r.ok()) << r.status();
  r->reset();
}

// Per-reservation keys: the decode node registers each page run of a reservation separately
// inside its registered arena and sends one descriptor per run; the prefill node connects once
// per run. All share one endpoint, and only the first Connect pays a round trip.
TEST_P(TransportConformanceTest, ManySubRangeRegistrationsConnectCheaplyAndStayInBounds) {
  constexpr size_t kRuns = 8;
  constexpr size_t kRunPages = 4;
  std::vector<std::unique_ptr<Registration>> runs;
  std::vector<std::unique_ptr<RemoteTarget>> targets;
  for (size_t i = 0; i < kRuns; ++i) {
    // Runs 0, 2, 4, ... pages apart by kRunPages * 2: gaps between them belong to no run.
    auto reg = target_->Register({arena_.data() + i * 2 * kRunPages * kPage, kRunPages * kPage});
    ASSERT_TRUE(reg.ok()) << reg.status();
    auto desc = (*reg)->Describe();
    ASSERT_TRUE(desc.ok()) << desc.status();
    ASSERT_EQ(desc->length, kRunPages * kPage);
    auto t = writer_->Connect(*desc);
    ASSERT_TRUE(t.ok()) << "run " << i << ": " << t.status();
    runs.push_back(*std::move(reg));
    targets.push_back(*std::move(t));
  }
#ifdef FLUXION_TRANSFER_CONFORMANCE_UCX
  EXPECT_EQ(static_cast<UcxTransport*>(writer_.get())->ConnectProbesForTesting(), 1u)
      << "one round trip per endpoint, not per descriptor";
#endif
  for (size_t i = 0; i < kRuns; ++i) {
    const uint64_t base = targets[i]->base_address();
    auto h = writer_->Write(*targets[i], {{base, SourcePage(i), kRunPages * kPage}});
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE((*h)->Wait(kLongWait).ok());
    // One byte before, one byte past, and the next run's first page: refused by the sender.
    for (const BlockCopy& c : std::vector<BlockCopy>{{base - 1, SourcePage(0), 1},
                                                     {base + kRunPages * kPage, SourcePage(0), 1},
                                                     {base + kRunPages * kPage - 8, SourcePage(0),
                                                      16}}) {
      auto out = writer_->Write(*targets[i], {c});
      EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << "run " << i;
    }
  }
  for (size_t i = 0; i < kRuns; ++i) {
    const uint8_t* run = arena_.data() + i * 2 * kRunPages * kPage;
    ASSERT_EQ(0, std::memcmp(run, SourcePage(i), kRunPages * kPage)) << "run " << i;
    // The gap after each run was never written.
    EXPECT_TRUE(std::all_of(run + kRunPages * kPage, run + 2 * kRunPages * kPage,
                            [](uint8_t b) { return b == 0; }))
        << "gap after run " << i;
  }
  targets.clear();
  runs.clear();
}

// A run's registration destroyed (the reservation ended) while the peer still holds its key:
// nothing breaks on either side, the other runs keep working, and a write through the revoked key
// fails at the target (FailedPrecondition, "revoked") with nothing landed, on every transport.
// (Before target-checked landings, UCX over TCP and shared memory wrote it anyway.)
TEST_P(TransportConformanceTest, RegistrationDestroyedWhilePeerHoldsItsKey) {
  auto run_a = target_->Register({arena_.data(), 4 * kPage});
  auto run_b = target_->Register({arena_.data() + 8 * kPage, 4 * kPage});
  ASSERT_TRUE(run_a.ok() && run_b.ok());
  const PeerDescriptor desc_a = *(*run_a)->Describe();
  auto a = writer_->Connect(desc_a);
  auto b = writer_->Connect(*(*run_b)->Describe());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  run_a->reset();  // revoked while the writer holds `a`

  auto still = writer_->Write(**b, {{(*b)->base_address(), SourcePage(2), kPage}});
  ASSERT_TRUE(still.ok()) << still.status();
  ASSERT_TRUE((*still)->Wait(kLongWait).ok());
  EXPECT_EQ(0, std::memcmp(arena_.data() + 8 * kPage, SourcePage(2), kPage));

  const uint64_t refused_before = target_->metrics().landing_refused;
  auto h = writer_->Write(**a, {{(*a)->base_address(), SourcePage(1), kPage},
                                {(*a)->base_address() + 2 * kPage, SourcePage(3), 100}});
  ASSERT_TRUE(h.ok()) << h.status();  // the writer cannot know: its descriptor is well-formed
  absl::Status s = (*h)->Wait(kLongWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("revoked")) << s;
  EXPECT_TRUE(std::all_of(arena_.begin(), arena_.begin() + 4 * kPage,
                          [](uint8_t x) { return x == 0; }));
  EXPECT_GT(target_->metrics().landing_refused, refused_before);
  // A fresh Connect with the stale descriptor is refused (loopback checks at once), or connects
  // without a round trip (UCX, endpoint already proved) and its writes are refused the same way.
  auto again = writer_->Connect(desc_a);
  if (again.ok()) {
    auto h2 = writer_->Write(**again, {{desc_a.base_address, SourcePage(4), kPage}});
    ASSERT_TRUE(h2.ok()) << h2.status();
    EXPECT_THAT((*h2)->Wait(kLongWait).message(), HasSubstr("revoked"));
    again->reset();
  }
  EXPECT_TRUE(std::all_of(arena_.begin(), arena_.begin() + 4 * kPage,
                          [](uint8_t x) { return x == 0; }));
  a->reset();  // releasing a key whose registration is gone is fine
  b->reset();
  run_b->reset();
}

// `d` with its key re-wrapped for [base, base + length) and that range advertised: the envelope's
// CRC is no secret, so this is what anyone holding one real descriptor can make. The writer's own
// checks (scope, range) all pass for it.
PeerDescriptor Widened(const PeerDescriptor& d, uint64_t base, uint64_t length) {
  absl::StatusOr<UnwrappedBlob> key = UnwrapBlob(BlobField::kRemoteKey, d.remote_key, 4096);
  EXPECT_TRUE(key.ok()) << key.status();
  PeerDescriptor forged = d;
  forged.remote_key = WrapBlob(BlobField::kRemoteKey, key.ok() ? key->payload : "", base, length);
  forged.base_address = base;
  forged.length = length;
  return forged;
}

// A real run's key re-wrapped with the whole arena as its scope. The target refuses every message
// outside the run (the arena around it holds another registration's pages), the batch fails
// cleanly, no byte outside the run changes, and the target keeps serving. (Before target-checked
// landings, UCX wrote 16.7 MB over another request's pages this way.)
TEST_P(TransportConformanceTest, ForgedWiderScopeLandsNothingOutsideTheRegistration) {
  std::fill(arena_.begin(), arena_.end(), 0xa5);  // sentinel
  auto run = target_->Register({arena_.data() + 16 * kPage, 8 * kPage});
  ASSERT_TRUE(run.ok()) << run.status();
  const PeerDescriptor real = *(*run)->Describe();
  const PeerDescriptor forged = Widened(real, ArenaAddr(0), kBytes);
  const uint64_t refused_before = target_->metrics().landing_refused;
  auto t = writer_->Connect(forged);
  if (t.ok()) {
    auto h = writer_->Write(**t, {{ArenaAddr(0), SourcePage(0), 4 * kPage},      // before the run
                                  {ArenaAddr(23), SourcePage(1), 2 * kPage},     // across its end
                                  {ArenaAddr(100), SourcePage(2), kPage},        // far after
                                  {ArenaAddr(18), SourcePage(3), kPage}});       // inside
    ASSERT_TRUE(h.ok()) << h.status();
    absl::Status s = (*h)->Wait(kLongWait);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("refused 3 of 4")) << s;
    EXPECT_GE(target_->metrics().landing_refused, refused_before + 3);
    t->reset();
  } else {
    // Loopback checks the descriptor against the registration at Connect already.
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  }
  for (size_t i = 0; i < kBytes; ++i) {
    if (i >= 16 * kPage && i < 24 * kPage) continue;  // the run itself
    ASSERT_EQ(arena_[i], 0xa5) << "byte " << i << " outside the run was written";
  }
  // The target keeps serving, through the real descriptor.
  auto honest = writer_->Connect(real);
  ASSERT_TRUE(honest.ok()) << honest.status();
  auto h = writer_->Write(**honest, {{ArenaAddr(16), SourcePage(7), 8 * kPage}});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*h)->Wait(kLongWait).ok());
  EXPECT_EQ(0, std::memcmp(arena_.data() + 16 * kPage, SourcePage(7), 8 * kPage));
  honest->reset();
  run->reset();
}

// A real key re-wrapped for a range no registration has, in memory the target process maps with
// no access at all: the target refuses it before touching memory (before target-checked landings,
// UCX's put handler segfaulted the decode node on such a range), and keeps serving.
TEST_P(TransportConformanceTest, RangeBeyondAnyRegistrationFailsCleanlyAndTheTargetSurvives) {
  constexpr size_t kGuard = 1 << 20;
  void* guard = mmap(nullptr, kGuard, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(guard, MAP_FAILED);
  const uint64_t where = reinterpret_cast<uintptr_t>(guard);
  ASSERT_NO_FATAL_FAILURE(ConnectOrDie());  // the endpoint exists: this Connect needs no trip
  auto t = writer_->Connect(Widened(descriptor_, where, kGuard));
  if (t.ok()) {
    auto h = writer_->Write(**t, {{where, SourcePage(0), kPage}, {where + kGuard - 64, SourcePage(1), 64}});
    ASSERT_TRUE(h.ok()) << h.status();
    absl::Status s = (*h)->Wait(kLongWait);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("outside the landing")) << s;
    t->reset();
  } else {
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  }
  auto h = writer_->Write(*remote_, {{ArenaAddr(3), SourcePage(3), kPage}});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*h)->Wait(kLongWait).ok());
  EXPECT_EQ(0, std::memcmp(arena_.data() + 3 * kPage, SourcePage(3), kPage));
  munmap(guard, kGuard);
}

INSTANTIATE_TEST_SUITE_P(All, TransportConformanceTest, ::testing::ValuesIn(AllBackends()),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace fluxion::transfer
