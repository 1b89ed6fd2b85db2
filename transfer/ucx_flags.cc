#include "transfer/ucx_flags.h"

namespace fluxion::transfer {

void UcxFlags::Register(FlagSet& flags) {
  flags.String("ucx-tls", &tls,
               "UCX transports (UCX_TLS), e.g. tcp or sm,self; empty: the environment's. On one "
               "host shared memory needs --noucx-peer-error-handling (docs/TRANSFER.md)");
  flags.String("ucx-net-devices", &net_devices,
               "UCX network devices (UCX_NET_DEVICES), e.g. lo; empty: the environment's");
  flags.Bool("ucx-peer-error-handling", &peer_error_handling,
             "detect dead peers through UCX (needs a transport with peer failure handling: TCP, "
             "RDMA; not shared memory in UCX 1.13)");
  flags.Int("ucx-keepalive-ms", &keepalive_ms, "UCX keepalive interval for dead-peer detection");
}

UcxOptions UcxFlags::ToOptions(const std::string& node_name,
                               const CompatibilityRecord& compat) const {
  UcxOptions o;
  o.node_name = node_name;
  o.compat = compat;
  if (!tls.empty()) o.config.push_back({"TLS", tls});
  if (!net_devices.empty()) o.config.push_back({"NET_DEVICES", net_devices});
  o.peer_error_handling = peer_error_handling;
  o.keepalive_interval = absl::Milliseconds(keepalive_ms);
  return o;
}

}  // namespace fluxion::transfer
