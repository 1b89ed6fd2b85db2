// The error guard's flags (error_guard.h), shared by every command that decodes: `fluxion
// generate`, `eval tasks`, `eval attention`, `bench attention`, `bench decode` and the decode node
// (`fluxion decode`), so the names, defaults and validation are the same everywhere.
//
//   --guard off|on       (eval tasks also `both`: every guardable policy with and without it)
//   --guard-rate R       share of (layer, KV head) pairs checked exactly per decode step
//   --guard-tolerance T  e_h above which a head's budget grows
//   --guard-relax R      e_h below R x T gives budget back
//   --guard-grow G, --guard-shrink S, --guard-max-weight W   the step sizes (error_guard.h)
#ifndef FLUXION_DECODE_SPARSE_GUARD_FLAGS_H_
#define FLUXION_DECODE_SPARSE_GUARD_FLAGS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/flag_set.h"
#include "decode/sparse/error_guard.h"
#include "decode/sparse/policy.h"

namespace fluxion::decode::sparse {

class GuardFlags {
 public:
  // Registers the flags on `flags` (which must outlive this object). `allow_both`: --guard both.
  explicit GuardFlags(FlagSet& flags, bool allow_both = false);

  // After parsing: the guard modes to run, {false}, {true} or {false, true} (both), and the
  // config with `enabled` unset. InvalidArgument naming the flag for a bad value.
  absl::StatusOr<std::vector<bool>> Modes() const;
  absl::StatusOr<GuardConfig> Config() const;
  // Both at once, the first error if any (what every command reads).
  struct Parsed {
    std::vector<bool> modes;
    GuardConfig config;
  };
  absl::StatusOr<Parsed> Read() const;

 private:
  bool allow_both_;
  std::string mode_ = "off";
  GuardConfig config_;
};

// `config` with the guard on (and `projection` set) for the guardable policies when `on`;
// unchanged otherwise.
PolicyConfig WithGuard(PolicyConfig config, bool on, const GuardConfig& guard,
                       std::shared_ptr<const model::OutputProjection> projection);

// Every config of `configs` under each mode of `modes` (error_guard off first): a guardable policy
// once per mode, the others once.
std::vector<PolicyConfig> ExpandGuard(const std::vector<PolicyConfig>& configs,
                                      const std::vector<bool>& modes, const GuardConfig& guard,
                                      std::shared_ptr<const model::OutputProjection> projection);

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_GUARD_FLAGS_H_
