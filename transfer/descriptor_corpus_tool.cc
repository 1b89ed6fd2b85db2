// Writes the seed corpus of transfer/descriptor_fuzz.cc: real serialized descriptors of this
// host's UCX (TCP on lo, shared memory, a registered and an allocated region) and loopback, and
// the raw UCX worker addresses and keys inside them. Not a test; run by hand when the formats
// change:  descriptor_corpus_tool tests/fuzz/corpus/descriptor_fuzz
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "transfer/descriptor_check.h"
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
  auto alloc = transport.Allocate(1 << 16);
  for (auto* r : {&reg, &alloc}) {
    if (!r->ok()) continue;
    const std::string which = r == &reg ? "registered" : "allocated";
    t::PeerDescriptor d = *(**r)->Describe();
    Write(dir, tag + "-" + which + "-descriptor", t::SerializeDescriptor(d));
    auto a = t::UnwrapBlob(t::BlobField::kWorkerAddress, d.worker_address,
                           t::kMaxUcxWorkerAddressBytes);
    auto k = t::UnwrapBlob(t::BlobField::kRemoteKey, d.remote_key, t::kMaxUcxRemoteKeyBytes);
    if (which == "registered") Write(dir, tag + "-worker-address", a->payload);
    Write(dir, tag + "-" + which + "-rkey", k->payload);
    Write(dir, tag + "-" + which + "-rkey-envelope", d.remote_key);
  }
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
  return 0;
}
