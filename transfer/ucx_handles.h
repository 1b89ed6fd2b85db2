// Owners for UCX handles, one per handle kind (NIXL's ucx_utils.h shape): each releases its
// handle exactly once and cannot be copied. Handles whose release needs worker progress
// (endpoints) are closed explicitly by UcxTransport, which documents how. Internal to transfer/.
//
// Thread-safety: none of their own. UcxTransport calls every UCX function, including these
// destructors, with its worker lock held (the worker runs in UCS_THREAD_MODE_SERIALIZED).
#ifndef FLUXION_TRANSFER_UCX_HANDLES_H_
#define FLUXION_TRANSFER_UCX_HANDLES_H_

#include <ucp/api/ucp.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace fluxion::transfer::ucx {

// absl::Status for a UCX status. Errors that mean "the peer or the path to it is gone" become
// Unavailable, a cancelled request (endpoint closed under it) too; the rest Internal.
inline absl::Status FromUcs(ucs_status_t status, absl::string_view what) {
  if (status == UCS_OK) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_TIMED_OUT:
      return absl::UnavailableError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::InvalidArgumentError(msg);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

struct ConfigDeleter {
  void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};
using ConfigPtr = std::unique_ptr<ucp_config_t, ConfigDeleter>;

struct ContextDeleter {
  void operator()(ucp_context_h c) const { ucp_cleanup(c); }
};
using ContextPtr = std::unique_ptr<std::remove_pointer_t<ucp_context_h>, ContextDeleter>;

struct WorkerDeleter {
  void operator()(ucp_worker_h w) const { ucp_worker_destroy(w); }
};
using WorkerPtr = std::unique_ptr<std::remove_pointer_t<ucp_worker_h>, WorkerDeleter>;

// A registered memory region (ucp_mem_map without allocation: the memory is ours).
// REQUIRES: destroyed before its context.
class MemoryHandle {
 public:
  static absl::StatusOr<std::unique_ptr<MemoryHandle>> Map(ucp_context_h context, void* addr,
                                                           size_t length) {
    ucp_mem_map_params_t params = {};
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = addr;
    params.length = length;
    ucp_mem_h memh = nullptr;
    if (ucs_status_t s = ucp_mem_map(context, &params, &memh); s != UCS_OK) {
      return FromUcs(s, absl::StrCat("ucp_mem_map of ", length, " bytes"));
    }
    return std::unique_ptr<MemoryHandle>(new MemoryHandle(context, memh));
  }
  ~MemoryHandle() { ucp_mem_unmap(context_, memh_); }
  MemoryHandle(const MemoryHandle&) = delete;
  MemoryHandle& operator=(const MemoryHandle&) = delete;

  ucp_mem_h get() const { return memh_; }

 private:
  MemoryHandle(ucp_context_h context, ucp_mem_h memh) : context_(context), memh_(memh) {}
  const ucp_context_h context_;
  const ucp_mem_h memh_;
};

// The worker's address as bytes (ucp_worker_get_address, copied and released at once).
inline absl::StatusOr<std::string> WorkerAddressBytes(ucp_worker_h worker) {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  if (ucs_status_t s = ucp_worker_get_address(worker, &address, &length); s != UCS_OK) {
    return FromUcs(s, "ucp_worker_get_address");
  }
  std::string bytes(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker, address);
  return bytes;
}

}  // namespace fluxion::transfer::ucx

#endif  // FLUXION_TRANSFER_UCX_HANDLES_H_
