// TLS and mutual TLS for every Fluxion gRPC server and client (docs/TLS.md): options read from
// flags, certificates and keys from PEM files, and the grpc credentials built from them.
//
// Plain (insecure) stays the default so the demo runs without certificates; servers then listen
// on loopback unless told otherwise. Credentials are built once at start-up, so an unreadable or
// malformed file stops the process with an error naming the flag and the path.
//
// Thread-compatible: configure and build from one thread; the credentials are thread-safe.
#ifndef FLUXION_COMMON_GRPC_SECURITY_H_
#define FLUXION_COMMON_GRPC_SECURITY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/flag_set.h"
#include "common/grpc_transport.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace fluxion::serving {

// What a server presents and whom it accepts. TLS is on when cert_file is set.
struct ServerTlsOptions {
  std::string cert_file;       // --tls-cert: PEM certificate chain the server presents
  std::string key_file;        // --tls-key: PEM private key of that certificate
  std::string client_ca_file;  // --tls-client-ca: PEM CA bundle client certificates must chain to
  bool require_client_cert = false;  // --tls-require-client-cert: refuse clients without one
  bool enabled() const { return !cert_file.empty(); }
};

// What a client trusts and presents. TLS is on when `tls` is set or any file is given.
struct ClientTlsOptions {
  // Flag names in messages: --<flag_prefix>-ca etc.
  std::string flag_prefix = "tls";
  bool tls = false;          // --<prefix>: TLS with the system's root CAs when no CA file is given
  std::string ca_file;       // --<prefix>-ca: PEM CA bundle the server's certificate must chain to
  std::string cert_file;     // --<prefix>-cert: client certificate chain (mutual TLS)
  std::string key_file;      // --<prefix>-key: its private key
  std::string server_name;   // --<prefix>-server-name: name to check instead of the target's host
  bool enabled() const {
    return tls || !ca_file.empty() || !cert_file.empty() || !key_file.empty();
  }
};

// --tls-cert, --tls-key, --tls-client-ca, --tls-require-client-cert.
void RegisterServerTlsFlags(FlagSet& flags, ServerTlsOptions* options);

// --<prefix>, --<prefix>-ca, --<prefix>-cert, --<prefix>-key, --<prefix>-server-name, for the
// channels to `peer` (words for the help text: "the router", "prefill nodes").
void RegisterClientTlsFlags(FlagSet& flags, const std::string& prefix, const std::string& peer,
                            ClientTlsOptions* options);

// Insecure credentials when TLS is off. INVALID_ARGUMENT naming the flag and path when a file
// cannot be read or is not PEM, or when the options contradict each other (a key without a
// certificate, required client certificates without a CA to check them).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const ServerTlsOptions& options);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientTlsOptions& options);

// ChannelCredentials() and the server name override, with the default keepalive policy: what
// CreateChannel() needs. Same errors as ChannelCredentials().
absl::StatusOr<ChannelConfig> ClientChannelConfig(const ClientTlsOptions& options);

}  // namespace fluxion::serving

#endif  // FLUXION_COMMON_GRPC_SECURITY_H_
