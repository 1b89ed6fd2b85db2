#include "cluster/router_policy.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fluxion::cluster {

double DecodeScore(const BackendState& node) {
  const v1::DecodeLoad& load = node.decode_load;
  double free_fraction = 1.0;
  if (load.total_kv_pages() > 0) {
    // Pages a pending prompt will take: one page per page_tokens tokens per (layer, KV head).
    const v1::ModelLayout& layout = load.server().layout();
    double pages_per_token = load.page_tokens() > 0
                                 ? std::max<uint32_t>(1, layout.num_layers()) *
                                       std::max<uint32_t>(1, layout.num_kv_heads()) /
                                       static_cast<double>(load.page_tokens())
                                 : 0.0;
    double free_pages = static_cast<double>(load.free_kv_pages()) -
                        pages_per_token * static_cast<double>(node.pending_prompt_tokens);
    free_fraction = std::max(0.0, free_pages) / static_cast<double>(load.total_kv_pages());
  }
  double requests = load.running_requests() + load.prefilling_requests() +
                    load.waiting_requests() + node.pending_requests;
  return free_fraction / (1.0 + requests);
}

namespace {

// "N known: F failed this request, U unhealthy" (the parts that are not 0). Which nodes and why is
// the operator's (the router's log and /metrics), not the client's: their addresses are internal.
std::string NodeCounts(size_t known, int failed, int unhealthy) {
  std::vector<std::string> parts;
  if (failed > 0) parts.push_back(absl::StrCat(failed, " failed this request"));
  if (unhealthy > 0) parts.push_back(absl::StrCat(unhealthy, " unhealthy"));
  return absl::StrCat(known, " known", parts.empty() ? "" : ": ", absl::StrJoin(parts, ", "));
}

}  // namespace

absl::StatusOr<std::string> PickDecode(const std::vector<BackendState>& decodes,
                                       int64_t prompt_tokens, double shed_kv_usage,
                                       const std::set<std::string>& exclude) {
  std::vector<const BackendState*> candidates;
  int failed = 0, unhealthy = 0;
  for (const BackendState& node : decodes) {
    if (exclude.count(node.address)) {
      ++failed;
    } else if (!node.healthy) {
      ++unhealthy;
    } else {
      candidates.push_back(&node);
    }
  }
  if (candidates.empty()) {
    return absl::UnavailableError(
        absl::StrCat("no healthy decode node (", NodeCounts(decodes.size(), failed, unhealthy),
                     "); retry later"));
  }
  std::vector<const BackendState*> below;
  float lowest = 1.0f;
  for (const BackendState* node : candidates) {
    lowest = std::min(lowest, node->decode_load.kv_usage());
    if (node->decode_load.kv_usage() < shed_kv_usage) below.push_back(node);
  }
  if (below.empty()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "all %d healthy decode nodes are at or above the KV usage threshold %.2f (lowest %.2f); "
        "retry later",
        static_cast<int>(candidates.size()), shed_kv_usage, lowest));
  }
  auto key = [prompt_tokens](const BackendState* n) {
    bool fits = n->decode_load.admittable_prompt_tokens() >= static_cast<uint64_t>(prompt_tokens);
    return std::make_tuple(fits, DecodeScore(*n));
  };
  const BackendState* best = below.front();
  for (const BackendState* n : below) {
    if (key(n) > key(best) || (key(n) == key(best) && n->address < best->address)) best = n;
  }
  return best->address;
}

absl::StatusOr<std::string> PickPrefill(const std::vector<BackendState>& prefills,
                                        const std::set<std::string>& exclude) {
  const BackendState* best = nullptr;
  auto key = [&exclude](const BackendState* n) {
    return std::make_tuple(exclude.count(n->address) > 0,
                           n->prefill_load.queued_prompt_tokens() + n->pending_prompt_tokens,
                           n->prefill_load.running_prompt_tokens(), n->address);
  };
  int unhealthy = 0;
  for (const BackendState& node : prefills) {
    if (!node.healthy) {
      ++unhealthy;
      continue;
    }
    if (best == nullptr || key(&node) < key(best)) best = &node;
  }
  if (best == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "no healthy prefill node (", NodeCounts(prefills.size(), 0, unhealthy), "); retry later"));
  }
  return best->address;
}

}  // namespace fluxion::cluster
