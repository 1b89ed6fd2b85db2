#include "proto/prefill_seal.h"

#include <sys/stat.h>

#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::proto {
namespace {

namespace v1 = ::fluxion::v1;
using ::testing::HasSubstr;

TransferSecret Secret(char fill) { return *TransferSecret::FromBytes(std::string(32, fill)); }

// A request shaped like the decode node's: a target range with a key, pages, a sparse target.
v1::PrefillRequest Request() {
  v1::PrefillRequest r;
  r.set_request_id("req-1#abc.1");
  r.add_prompt_token_ids(5);
  r.add_prompt_token_ids(7);
  v1::KvTarget* kv = r.mutable_kv_target();
  kv->set_transport("ucx");
  kv->set_peer_name("decode-0");
  kv->set_worker_address("worker-address-bytes");
  kv->set_arena_base_address(0x7f0000000000);
  kv->set_arena_bytes(1 << 20);
  kv->set_page_bytes(8192);
  v1::RemoteRange* range = kv->add_ranges();
  range->set_base_address(0x7f0000002000);
  range->set_length(16384);
  range->set_remote_key("key-bytes");
  v1::PageExtent* e = kv->add_extents();
  e->set_first_page_id(1);
  e->set_count(2);
  return r;
}

const absl::Time kNow = absl::FromUnixSeconds(1'800'000'000);

TEST(PrefillSealTest, ASealedRequestChecksAndNamesItsKey) {
  const TransferSecret secret = Secret('a');
  v1::PrefillRequest r = Request();
  SealPrefillRequest(secret, kNow + absl::Minutes(1), &r);
  EXPECT_EQ(r.seal().mac().size(), kSealMacBytes);
  EXPECT_EQ(r.seal().key_id(), secret.key_id());
  EXPECT_EQ(secret.key_id().size(), 16u);
  EXPECT_TRUE(CheckPrefillSeal(secret, r, kNow).ok());
}

// Every field that decides where the prefill node writes is covered: a widened key scope, a range
// moved, another page, another worker address or request id each break the seal.
TEST(PrefillSealTest, ChangingAnyTargetFieldBreaksTheSeal) {
  const TransferSecret secret = Secret('a');
  v1::PrefillRequest sealed = Request();
  SealPrefillRequest(secret, kNow + absl::Minutes(1), &sealed);
  const std::vector<std::function<void(v1::PrefillRequest*)>> edits = {
      [](v1::PrefillRequest* r) { r->mutable_kv_target()->mutable_ranges(0)->set_length(1 << 20); },
      [](v1::PrefillRequest* r) {
        r->mutable_kv_target()->mutable_ranges(0)->set_base_address(0x7f0000100000);
      },
      [](v1::PrefillRequest* r) { r->mutable_kv_target()->mutable_ranges(0)->set_remote_key("k2"); },
      [](v1::PrefillRequest* r) { r->mutable_kv_target()->mutable_extents(0)->set_count(200); },
      [](v1::PrefillRequest* r) { r->mutable_kv_target()->set_worker_address("elsewhere"); },
      [](v1::PrefillRequest* r) { r->mutable_kv_target()->set_arena_bytes(1ull << 40); },
      [](v1::PrefillRequest* r) { r->set_request_id("req-2#abc.1"); },
      [](v1::PrefillRequest* r) { r->add_prompt_token_ids(9); },
      [](v1::PrefillRequest* r) { r->mutable_sparse_target()->set_base_address(0x10000); },
      [](v1::PrefillRequest* r) {
        r->mutable_seal()->set_expires_unix_ms(r->seal().expires_unix_ms() + 3'600'000);
      },
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    v1::PrefillRequest r = sealed;
    edits[i](&r);
    absl::Status s = CheckPrefillSeal(secret, r, kNow);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << "edit " << i;
    EXPECT_THAT(s.message(), HasSubstr("does not match its contents")) << "edit " << i;
  }
}

TEST(PrefillSealTest, RefusesMissingForeignExpiredAndOverlongSeals) {
  const TransferSecret secret = Secret('a');
  v1::PrefillRequest unsealed = Request();
  EXPECT_THAT(CheckPrefillSeal(secret, unsealed, kNow).message(),
              HasSubstr("--transfer-secret-file"));

  v1::PrefillRequest other = Request();
  SealPrefillRequest(Secret('b'), kNow + absl::Minutes(1), &other);
  absl::Status s = CheckPrefillSeal(secret, other, kNow);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr(secret.key_id()));
  EXPECT_THAT(s.message(), HasSubstr(Secret('b').key_id()));

  v1::PrefillRequest forged = other;  // the right key id, a MAC made with another secret
  forged.mutable_seal()->set_key_id(secret.key_id());
  EXPECT_THAT(CheckPrefillSeal(secret, forged, kNow).message(), HasSubstr("does not match"));

  v1::PrefillRequest r = Request();
  SealPrefillRequest(secret, kNow + absl::Seconds(10), &r);
  EXPECT_TRUE(CheckPrefillSeal(secret, r, kNow + absl::Seconds(10)).ok());
  s = CheckPrefillSeal(secret, r, kNow + absl::Seconds(11));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("expired"));

  SealPrefillRequest(secret, kNow + kMaxSealLifetime + absl::Seconds(1), &r);
  EXPECT_THAT(CheckPrefillSeal(secret, r, kNow).message(), HasSubstr("more than"));

  v1::PrefillRequest short_mac = Request();
  SealPrefillRequest(secret, kNow + absl::Minutes(1), &short_mac);
  short_mac.mutable_seal()->mutable_mac()->resize(16);
  EXPECT_EQ(CheckPrefillSeal(secret, short_mac, kNow).code(), absl::StatusCode::kPermissionDenied);
}

TEST(PrefillSealTest, SecretsAreReadFromFilesWithTheirLimits) {
  ScopedTestTempDir dir;
  const std::string path = dir.dir() + "/secret";
  ASSERT_TRUE(WriteNewTransferSecret(path).ok());
  struct stat st = {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  absl::StatusOr<TransferSecret> a = TransferSecret::FromFile(path);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(WriteNewTransferSecret(path).ok());  // replaced: a new secret
  absl::StatusOr<TransferSecret> b = TransferSecret::FromFile(path);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(a->key_id(), b->key_id());

  EXPECT_THAT(TransferSecret::FromFile(dir.dir() + "/missing").status().message(),
              HasSubstr("--transfer-secret-file"));
  std::ofstream(dir.dir() + "/short") << "0123456789abcdef0123456789abcde\n";  // 31 + newline
  EXPECT_THAT(TransferSecret::FromFile(dir.dir() + "/short").status().message(),
              HasSubstr("31 bytes"));
  std::ofstream(dir.dir() + "/long") << std::string(kMaxTransferSecretBytes + 1, 'x');
  EXPECT_FALSE(TransferSecret::FromFile(dir.dir() + "/long").ok());
  // One trailing newline is not part of the secret: a file and the same bytes agree.
  std::ofstream(dir.dir() + "/nl") << std::string(40, 'z') << "\n";
  EXPECT_EQ(TransferSecret::FromFile(dir.dir() + "/nl")->key_id(),
            TransferSecret::FromBytes(std::string(40, 'z'))->key_id());
}

}  // namespace
}  // namespace fluxion::proto
