// The UCX settings both services take on their command line (`fluxion prefill`, `fluxion
// decode`), so that one host can pick shared memory or TCP without environment variables.
// UCX_* environment variables still apply underneath; these flags override them.
//
// Thread-compatible.
#ifndef FLUXION_TRANSFER_UCX_FLAGS_H_
#define FLUXION_TRANSFER_UCX_FLAGS_H_

#include <cstdint>
#include <string>

#include "common/flag_set.h"
#include "transfer/ucx_transport.h"

namespace fluxion::transfer {

struct UcxFlags {
  std::string tls;          // UCX_TLS, e.g. "tcp" or "sm,self"; empty: the environment's
  std::string net_devices;  // UCX_NET_DEVICES, e.g. "lo"; empty: the environment's
  bool peer_error_handling = true;
  int64_t keepalive_ms = 2000;

  // Registers --ucx-tls, --ucx-net-devices, --ucx-peer-error-handling, --ucx-keepalive-ms.
  void Register(FlagSet& flags);
  // Options for NewUcxTransport.
  UcxOptions ToOptions(const std::string& node_name, const CompatibilityRecord& compat) const;
};

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_UCX_FLAGS_H_
