// Writes the seed corpus of transfer/descriptor_fuzz.cc: real serialized descriptors of this
// host's UCX (TCP on lo, shared memory) and loopback, the raw UCX worker addresses and keys inside
// them, and one header of each landing message. Not a test; run by hand when the formats change:
//   descriptor_corpus_tool tests/fuzz/corpus/descriptor_fuzz
#include <array>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "transfer/descriptor_check.h"
#include "transfer/landing_wire.h"
#include "transfer/loopback_transport.h"
#include "transfer/transport.h"
#include "transfer/ucx_transport.h"

namespace t = fluxion::transfer;

namespace {

void Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

t::CompatibilityRecord Compat() {
  t::CompatibilityRecord c;
  c.model_id = "sha256:seed-model";
  c.kv_dtype = 2;
  c.num_layers = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.page_tokens = 16;
  c.layout_version = 1;
  return c;
}

void Seeds(const std::string& dir, const std::string& tag, t::Transport& transport) {
  std::vector<char> arena(1 << 16);
  auto reg = transport.Register({arena.data(), arena.size()});
  if (!reg.ok()) return;
  t::PeerDescriptor d = *(*reg)->Describe();
  Write(dir, tag + "-descriptor", t::SerializeDescriptor(d));
  auto a = t::UnwrapBlob(t::BlobField::kWorkerAddress, d.worker_address,
                         t::kMaxUcxWorkerAddressBytes);
  auto k = t::UnwrapBlob(t::BlobField::kRemoteKey, d.remote_key, t::kMaxUcxRemoteKeyBytes);
  Write(dir, tag + "-worker-address", a->payload);
  Write(dir, tag + "-key", k->payload);
  Write(dir, tag + "-key-envelope", d.remote_key);
}

template <size_t N>
std::string Bytes(const std::array<uint8_t, N>& a) {
  return std::string(reinterpret_cast<const char*>(a.data()), N);
}

void LandingSeeds(const std::string& dir) {
  t::landing::Token token;
  for (size_t i = 0; i < token.size(); ++i) token[i] = static_cast<uint8_t>(i * 17 + 3);
  Write(dir, "landing-write-header",
        Bytes(t::landing::PackWriteHeader({token, 0x5eed, 7, 0x7f0000001000})));
  Write(dir, "landing-fence-header", Bytes(t::landing::PackFenceHeader({0x5eed, 7, 128, 1 << 20})));
  t::landing::Ack ack;
  ack.stream = 0x5eed;
  ack.batch = 7;
  ack.accepted = 126;
  ack.accepted_bytes = 126 * 8192;
  ack.refused = 2;
  ack.first_refusal = t::landing::Refusal::kUnknownToken;
  Write(dir, "landing-ack", Bytes(t::landing::PackAck(ack)));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  struct Config {
    const char* tag;
    std::vector<std::pair<std::string, std::string>> ucx;
    bool peer_error_handling;
  };
  for (const Config& c : {Config{"ucx-tcp", {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}}, true},
                          Config{"ucx-shm", {{"TLS", "sm,self"}}, false}}) {
    t::UcxOptions o;
    o.node_name = "decode-seed";
    o.compat = Compat();
    o.config = c.ucx;
    o.peer_error_handling = c.peer_error_handling;
    auto transport = t::NewUcxTransport(o);
    if (!transport.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.tag, transport.status().ToString().c_str());
      return 1;
    }
    Seeds(dir, c.tag, **transport);
  }
  t::LoopbackTransport loopback({"decode-seed", Compat()});
  Seeds(dir, "loopback", loopback);
  LandingSeeds(dir);
  return 0;
}
