// device_prefill.h in a build without CUDA: Create says so; nothing else is reachable.
#include "prefill/device_prefill.h"

namespace fluxion::prefill {

struct DevicePrefill::Impl {
  model::ModelConfig config;
};

DevicePrefill::DevicePrefill(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DevicePrefill::~DevicePrefill() = default;

const model::ModelConfig& DevicePrefill::config() const { return impl_->config; }

absl::StatusOr<uint8_t*> DevicePrefill::HostStaging(size_t) {
  return absl::FailedPreconditionError("this build of fluxion has no CUDA: no device prefill");
}

absl::StatusOr<std::unique_ptr<DevicePrefill>> DevicePrefill::Create(
    const model::ModelConfig&, std::unique_ptr<model::DenseOps>, model::ModelParams,
    const DevicePrefillOptions&) {
  return absl::FailedPreconditionError("this build of fluxion has no CUDA: no device prefill");
}

absl::StatusOr<DevicePrefillResult> DevicePrefill::Run(absl::Span<const int32_t>, int64_t, bool,
                                                       bool, const std::function<bool()>&,
                                                       const PiecesReady&) {
  return absl::FailedPreconditionError("this build of fluxion has no CUDA: no device prefill");
}

absl::StatusOr<std::vector<absl::StatusOr<DevicePrefillResult>>> DevicePrefill::RunBatch(
    absl::Span<const DevicePrompt>, const BatchPiecesReady&) {
  return absl::FailedPreconditionError("this build of fluxion has no CUDA: no device prefill");
}

absl::Status DevicePrefill::CopyPages(size_t, int, int64_t, int64_t, uint8_t*, uint8_t*) {
  return absl::FailedPreconditionError("this build of fluxion has no CUDA: no device prefill");
}

}  // namespace fluxion::prefill
