#include "common/grpc_security.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fluxion::serving {
namespace {

// The file's text; INVALID_ARGUMENT naming the flag when it cannot be read or holds no PEM block.
absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " ", path, ": cannot read (", std::strerror(errno), ")"));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " ", path, ": not a PEM file (no -----BEGIN line)"));
  }
  return text.str();
}

}  // namespace

void RegisterServerTlsFlags(FlagSet& flags, ServerTlsOptions* options) {
  flags.String("tls-cert", &options->cert_file,
               "PEM certificate chain to serve TLS with (empty: plain, no TLS; docs/TLS.md)");
  flags.String("tls-key", &options->key_file, "PEM private key of --tls-cert");
  flags.String("tls-client-ca", &options->client_ca_file,
               "PEM CA bundle that client certificates must chain to (mutual TLS)");
  flags.Bool("tls-require-client-cert", &options->require_client_cert,
             "refuse clients without a certificate from --tls-client-ca");
}

void RegisterClientTlsFlags(FlagSet& flags, const std::string& prefix, const std::string& peer,
                            ClientTlsOptions* options) {
  options->flag_prefix = prefix;
  flags.Bool(prefix, &options->tls,
             absl::StrCat("TLS to ", peer, " (implied by the other --", prefix,
                          "-* flags; without --", prefix, "-ca: the system's root CAs)"));
  flags.String(prefix + "-ca", &options->ca_file,
               absl::StrCat("PEM CA bundle that the certificates of ", peer, " must chain to"));
  flags.String(prefix + "-cert", &options->cert_file,
               absl::StrCat("PEM client certificate chain presented to ", peer, " (mutual TLS)"));
  flags.String(prefix + "-key", &options->key_file, absl::StrCat("PEM private key of --", prefix,
                                                                 "-cert"));
  flags.String(prefix + "-server-name", &options->server_name,
               absl::StrCat("name to check in the certificates of ", peer,
                            " instead of the address's host (e.g. when dialling IP addresses)"));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const ServerTlsOptions& options) {
  if (!options.enabled()) {
    if (!options.key_file.empty() || !options.client_ca_file.empty() ||
        options.require_client_cert) {
      return absl::InvalidArgumentError(
          "--tls-key, --tls-client-ca and --tls-require-client-cert need --tls-cert");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.key_file.empty()) return absl::InvalidArgumentError("--tls-cert needs --tls-key");
  if (options.require_client_cert && options.client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-require-client-cert needs --tls-client-ca (the CA client certificates must chain "
        "to)");
  }
  auto cert = ReadPem("tls-cert", options.cert_file);
  if (!cert.ok()) return cert.status();
  auto key = ReadPem("tls-key", options.key_file);
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl(
      options.client_ca_file.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : (options.require_client_cert
                 ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                 : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY));
  if (!options.client_ca_file.empty()) {
    auto ca = ReadPem("tls-client-ca", options.client_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  ssl.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  return grpc::SslServerCredentials(ssl);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientTlsOptions& options) {
  if (!options.enabled()) return grpc::InsecureChannelCredentials();
  const std::string& p = options.flag_prefix;
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", p, "-cert and --", p, "-key go together (mutual TLS)"));
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.ca_file.empty()) {
    auto ca = ReadPem(p + "-ca", options.ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!options.cert_file.empty()) {
    auto cert = ReadPem(p + "-cert", options.cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(p + "-key", options.key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::SslCredentials(ssl);
  if (credentials == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--", p, "-*: grpc refused the TLS options"));
  }
  return credentials;
}

absl::StatusOr<ChannelConfig> ClientChannelConfig(const ClientTlsOptions& options) {
  auto credentials = ChannelCredentials(options);
  if (!credentials.ok()) return credentials.status();
  ChannelConfig config;
  config.credentials = *std::move(credentials);
  if (options.enabled()) config.tls_server_name = options.server_name;
  return config;
}

}  // namespace fluxion::serving
