// Test-only helpers for TLS: a throwaway PKI generated at run time with the `openssl` command
// (Debian package openssl, installed by tools/setup.sh), so no key is ever checked in.
// Header-only, for tests in common/, decode/ and cluster/.
#ifndef FLUXION_COMMON_GRPC_TESTING_H_
#define FLUXION_COMMON_GRPC_TESTING_H_

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_security.h"

namespace fluxion::serving::testing {

// Files under `dir` after MakeTestPki(dir): two unrelated CAs, a server certificate from the
// first (names localhost and 127.0.0.1), one client certificate from each.
struct TestPki {
  std::string ca, server_cert, server_key, client_cert, client_key;
  std::string other_ca, other_client_cert, other_client_key;

  ServerTlsOptions Server(bool require_client_cert) const {
    ServerTlsOptions o;
    o.cert_file = server_cert;
    o.key_file = server_key;
    o.client_ca_file = ca;
    o.require_client_cert = require_client_cert;
    return o;
  }
  // Trusts the server's CA; presents the client certificate from `ca` (or none).
  ClientTlsOptions Client(bool with_cert, bool from_other_ca = false) const {
    ClientTlsOptions o;
    o.ca_file = ca;
    if (with_cert) {
      o.cert_file = from_other_ca ? other_client_cert : client_cert;
      o.key_file = from_other_ca ? other_client_key : client_key;
    }
    return o;
  }
};

inline bool HaveOpenssl() { return std::system("command -v openssl >/dev/null 2>&1") == 0; }

inline absl::Status RunShell(const std::string& command) {
  if (std::system(command.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("failed: ", command));
  }
  return absl::OkStatus();
}

// P-256 keys (fast to make), one-day validity.
inline absl::Status MakeTestPki(const std::string& dir, TestPki* pki) {
  const std::string d = dir + "/";
  const std::string q = " >/dev/null 2>&1";
  const std::string key = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  for (const char* ca : {"ca", "other_ca"}) {
    if (auto s = RunShell(absl::StrCat(
            "openssl req -x509", key, " -keyout ", d, ca, ".key -out ", d, ca,
            ".pem -days 1 -subj /CN=fluxion-test-", ca,
            " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=keyCertSign,cRLSign", q));
        !s.ok()) {
      return s;
    }
  }
  std::ofstream(d + "server.ext") << "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                  << "extendedKeyUsage=serverAuth\n";
  std::ofstream(d + "client.ext") << "extendedKeyUsage=clientAuth\n";
  struct Leaf {
    const char* name;
    const char* ca;
    const char* ext;
  };
  for (const Leaf& leaf : {Leaf{"server", "ca", "server.ext"}, Leaf{"client", "ca", "client.ext"},
                           Leaf{"other_client", "other_ca", "client.ext"}}) {
    if (auto s = RunShell(absl::StrCat(
            "openssl req", key, " -keyout ", d, leaf.name, ".key -out ", d, leaf.name,
            ".csr -subj /CN=", leaf.name, q, " && openssl x509 -req -in ", d, leaf.name,
            ".csr -CA ", d, leaf.ca, ".pem -CAkey ", d, leaf.ca, ".key -CAcreateserial -days 1",
            " -extfile ", d, leaf.ext, " -out ", d, leaf.name, ".pem", q));
        !s.ok()) {
      return s;
    }
  }
  pki->ca = d + "ca.pem";
  pki->server_cert = d + "server.pem";
  pki->server_key = d + "server.key";
  pki->client_cert = d + "client.pem";
  pki->client_key = d + "client.key";
  pki->other_ca = d + "other_ca.pem";
  pki->other_client_cert = d + "other_client.pem";
  pki->other_client_key = d + "other_client.key";
  return absl::OkStatus();
}

}  // namespace fluxion::serving::testing

#endif  // FLUXION_COMMON_GRPC_TESTING_H_
