#include "proto/prefill_seal.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/secret_token.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace fluxion::proto {
namespace {

namespace v1 = ::fluxion::v1;

constexpr absl::string_view kSealTag = "fluxion.v1.PrefillSeal/1";

// What the MAC covers: the tag, a zero byte, the expiry (8 bytes little-endian) and the request
// without its seal, serialized deterministically (map order fixed; both nodes run one protobuf).
std::string SealedBytes(const v1::PrefillRequest& request, uint64_t expires_unix_ms) {
  std::string out(kSealTag);
  out.push_back('\0');
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((expires_unix_ms >> (8 * i)) & 0xff));
  v1::PrefillRequest unsealed = request;
  unsealed.clear_seal();
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  unsealed.SerializeToCodedStream(&coded);
  coded.Trim();
  return out;
}

}  // namespace

TransferSecret::TransferSecret(std::string secret) : secret_(std::move(secret)) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(secret_.data(), secret_.size(), digest, &length, EVP_sha256(), nullptr);
  key_id_ = absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), std::min(length, 8u)));
}

absl::StatusOr<TransferSecret> TransferSecret::FromBytes(std::string bytes) {
  if (!bytes.empty() && bytes.back() == '\n') bytes.pop_back();
  if (bytes.size() < kMinTransferSecretBytes || bytes.size() > kMaxTransferSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the transfer secret has ", bytes.size(), " bytes; it needs ", kMinTransferSecretBytes,
        " to ", kMaxTransferSecretBytes, " (make one with `openssl rand -hex 32 > FILE`)"));
  }
  return TransferSecret(std::move(bytes));
}

absl::StatusOr<TransferSecret> TransferSecret::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--transfer-secret-file ", path, " cannot be read: ", std::strerror(errno),
        " (every decode and prefill node needs the same secret; make one with "
        "`openssl rand -hex 32 > FILE`)"));
  }
  std::string bytes(kMaxTransferSecretBytes + 2, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  bytes.resize(static_cast<size_t>(in.gcount()));
  absl::StatusOr<TransferSecret> secret = FromBytes(std::move(bytes));
  if (!secret.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--transfer-secret-file ", path, ": ", secret.status().message()));
  }
  return secret;
}

std::string TransferSecret::Mac(absl::string_view message) const {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret_.data(), static_cast<int>(secret_.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &length);
  return std::string(reinterpret_cast<const char*>(mac), length);
}

absl::Status WriteNewTransferSecret(const std::string& path) {
  absl::StatusOr<std::string> hex = RandomHexToken(32);
  if (!hex.ok()) return hex.status();
  const std::string contents = *hex + "\n";
  // Replace, never append to or widen an existing file: unlink, then create exclusively 0600.
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::InternalError(absl::StrCat("removing ", path, ": ", std::strerror(errno)));
  }
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("creating ", path, ": ", std::strerror(errno)));
  const ssize_t wrote = write(fd, contents.data(), contents.size());
  const int saved = errno;
  close(fd);
  if (wrote != static_cast<ssize_t>(contents.size())) {
    return absl::InternalError(absl::StrCat("writing ", path, ": ", std::strerror(saved)));
  }
  return absl::OkStatus();
}

void SealPrefillRequest(const TransferSecret& secret, absl::Time expires,
                        v1::PrefillRequest* request) {
  const uint64_t expires_ms = static_cast<uint64_t>(std::max<int64_t>(0, absl::ToUnixMillis(expires)));
  request->clear_seal();
  const std::string mac = secret.Mac(SealedBytes(*request, expires_ms));
  v1::PrefillSeal* seal = request->mutable_seal();
  seal->set_expires_unix_ms(expires_ms);
  seal->set_key_id(secret.key_id());
  seal->set_mac(mac);
}

absl::Status CheckPrefillSeal(const TransferSecret& secret, const v1::PrefillRequest& request,
                              absl::Time now) {
  if (!request.has_seal()) {
    return absl::PermissionDeniedError(
        "the prefill request carries no seal: start the decode node with the same "
        "--transfer-secret-file as this prefill node");
  }
  const v1::PrefillSeal& seal = request.seal();
  if (seal.key_id() != secret.key_id()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the prefill request is sealed with transfer secret '",
        absl::CHexEscape(seal.key_id().substr(0, 32)), "', this prefill node holds '",
        secret.key_id(), "': give both nodes the same --transfer-secret-file"));
  }
  if (seal.mac().size() != kSealMacBytes ||
      CRYPTO_memcmp(seal.mac().data(), secret.Mac(SealedBytes(request, seal.expires_unix_ms())).data(),
                    kSealMacBytes) != 0) {
    return absl::PermissionDeniedError(
        "the prefill request's seal does not match its contents: it was altered after the decode "
        "node sealed it, or made without the secret");
  }
  const absl::Time expires =
      absl::FromUnixMillis(static_cast<int64_t>(std::min<uint64_t>(seal.expires_unix_ms(), INT64_MAX)));
  if (now > expires) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the prefill request's seal expired at ", absl::FormatTime(expires), ", ",
        absl::FormatDuration(now - expires), " ago (a replay, or clocks further apart than ",
        absl::FormatDuration(kSealClockSkew), ")"));
  }
  if (expires - now > kMaxSealLifetime) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the prefill request's seal is valid until ", absl::FormatTime(expires), ", more than ",
        absl::FormatDuration(kMaxSealLifetime), " from now (decode and prefill clocks disagree)"));
  }
  return absl::OkStatus();
}

}  // namespace fluxion::proto
