#include "cluster/prefill_pick.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace fluxion::cluster {
namespace {

// At most 256 bytes of a client's value in a message.
std::string Quoted(absl::string_view value) {
  return absl::StrCat("'", value.size() > 256 ? absl::StrCat(value.substr(0, 256), "...") : value,
                      "'");
}

}  // namespace

absl::StatusOr<std::string> MapPrefillerPick(absl::string_view header, absl::string_view pick,
                                             const std::vector<BackendState>& prefills) {
  absl::string_view value = absl::StripAsciiWhitespace(pick);
  // x-prefiller-url: "http://host:port" (a trailing path is no part of the pick).
  if (!absl::ConsumePrefix(&value, "http://")) absl::ConsumePrefix(&value, "https://");
  value = value.substr(0, value.find('/'));
  absl::StatusOr<std::pair<std::string, int>> split =
      absl::StrContains(value, ':') || value.empty()
          ? SplitHostPort(std::string(value))
          : std::make_pair(std::string(value), 0);  // a bare host: its one prefill node
  if (!split.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        header, " ", Quoted(pick), " is not host:port (the prefill pod the gateway picked)"));
  }
  std::vector<std::string> same_host, known;
  for (const BackendState& node : prefills) {
    known.push_back(node.address);
    if (node.address == value) return node.address;
    auto node_split = SplitHostPort(node.address);
    if (node_split.ok() && node_split->first == split->first) same_host.push_back(node.address);
  }
  if (same_host.size() == 1) return same_host[0];
  if (known.size() > 8) {
    known.resize(8);
    known.push_back("...");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      header, " ", Quoted(pick),
      same_host.empty()
          ? " names no prefill node of this router (it honours only its --prefill / "
            "--prefill-dns nodes, the ones its decode nodes trust): "
          : " names a host with several prefill nodes and none on that port: ",
      known.empty() ? "none known yet" : absl::StrJoin(known, ", "),
      "; check the gateway's prefill pool, or drop the header to let the router pick"));
}

}  // namespace fluxion::cluster
