#include "proto/convert.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/sparse_state.h"
#include "transfer/crc32c.h"

namespace fluxion::proto {
namespace {

uint32_t ExtendWithFile(uint32_t crc, const std::filesystem::path& path, size_t limit) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> buf(limit);
  in.read(buf.data(), static_cast<std::streamsize>(limit));
  return transfer::Crc32cExtend(crc, buf.data(), static_cast<size_t>(in.gcount()));
}

}  // namespace

absl::StatusOr<std::string> ModelFingerprint(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const fs::path dir(model_dir);
  std::error_code ec;
  if (!fs::exists(dir / "config.json", ec)) {
    return absl::NotFoundError(absl::StrCat("no config.json in ", model_dir));
  }
  uint32_t crc = ExtendWithFile(0, dir / "config.json", 1 << 20);
  std::vector<fs::path> weights;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors") weights.push_back(entry.path());
  }
  std::sort(weights.begin(), weights.end());
  for (const fs::path& w : weights) {
    const std::string name = w.filename().string();
    const uint64_t size = fs::file_size(w, ec);
    crc = transfer::Crc32cExtend(crc, name.data(), name.size());
    crc = transfer::Crc32cExtend(crc, &size, sizeof(size));
    crc = ExtendWithFile(crc, w, 1 << 20);
  }
  return absl::StrFormat("crc32c-%08x", crc);
}

fluxion::v1::ModelLayout LayoutFor(const model::ModelConfig& config, const std::string& model_id,
                                   const std::string& model_hash, int64_t page_tokens) {
  fluxion::v1::ModelLayout layout;
  layout.set_model_id(model_id);
  layout.set_model_hash(model_hash);
  layout.set_kv_dtype(fluxion::v1::DTYPE_BF16);
  layout.set_num_layers(static_cast<uint32_t>(config.num_layers));
  layout.set_num_kv_heads(static_cast<uint32_t>(config.num_kv_heads));
  layout.set_head_dim(static_cast<uint32_t>(config.head_dim));
  layout.set_page_tokens(static_cast<uint32_t>(page_tokens));
  layout.set_layout_version(1);
  layout.set_sparse_state_format_version(model::kSparseStateVersion);
  return layout;
}

transfer::CompatibilityRecord CompatibilityOf(const fluxion::v1::ModelLayout& layout,
                                              uint32_t protocol_version) {
  transfer::CompatibilityRecord r;
  r.protocol_version = protocol_version == 0 ? 1 : protocol_version;
  r.model_id = layout.model_hash().empty() ? layout.model_id() : layout.model_hash();
  r.kv_dtype = static_cast<uint32_t>(layout.kv_dtype());
  r.num_layers = layout.num_layers();
  r.num_kv_heads = layout.num_kv_heads();
  r.head_dim = layout.head_dim();
  r.page_tokens = layout.page_tokens();
  r.layout_version = layout.layout_version();
  return r;
}

absl::StatusOr<model::SamplingParams> SamplingFromProto(const fluxion::v1::SamplingParams& p) {
  model::SamplingParams s;
  s.temperature = p.has_temperature() ? p.temperature() : 1.0;
  s.top_p = p.has_top_p() ? p.top_p() : 1.0;
  s.top_k = p.top_k();
  if (!std::isfinite(s.temperature) || s.temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.temperature must be >= 0 (0 = greedy), got ", p.temperature()));
  }
  if (!(s.top_p > 0 && s.top_p <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_p must be in (0, 1], got ", p.top_p()));
  }
  if (p.has_seed()) {
    s.seed = p.seed();
  } else {
    std::random_device rd;
    s.seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  if (p.has_logprobs()) {
    if (p.logprobs() > static_cast<uint32_t>(model::kMaxTopLogprobs)) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.logprobs must be at most ",
                                                     model::kMaxTopLogprobs, ", got ",
                                                     p.logprobs()));
    }
    s.logprobs = static_cast<int32_t>(p.logprobs());
  }
  s.penalties.presence = p.presence_penalty();
  s.penalties.frequency = p.frequency_penalty();
  s.penalties.repetition = p.has_repetition_penalty() ? p.repetition_penalty() : 1.0;
  s.penalties.min_tokens = p.min_tokens();
  if (p.has_max_tokens() && p.min_tokens() > p.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.min_tokens (", p.min_tokens(),
                                                   ") must be at most max_tokens (",
                                                   p.max_tokens(), ")"));
  }
  // Held back while min_tokens is not reached (a decode node adds EOS to them).
  s.penalties.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  absl::Status valid = model::ValidateSamplingParams(s);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("sampling: ", valid.message()));
  return s;
}

absl::Status ValidatePromptLogprobs(const fluxion::v1::SamplingParams& p, int64_t prompt_tokens) {
  if (!p.has_prompt_logprobs()) return absl::OkStatus();
  const int64_t top = p.prompt_logprobs();
  if (top > model::kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.prompt_logprobs must be at most ",
                                                   model::kMaxTopLogprobs, ", got ", top));
  }
  if (prompt_tokens * (top + 1) > kMaxPromptLogprobEntries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.prompt_logprobs: ", prompt_tokens, " prompt tokens x (", top,
        " + 1) log-probabilities exceed the ", kMaxPromptLogprobEntries,
        " one request may ask for; ask for fewer alternatives or a shorter prompt"));
  }
  return absl::OkStatus();
}

void TokenLogprobsToProto(const model::TokenLogprobs& l, fluxion::v1::TokenLogprobs* out) {
  out->set_logprob(l.logprob);
  for (int32_t id : l.top_ids) out->add_top_token_ids(static_cast<uint32_t>(id));
  for (float lp : l.top_logprobs) out->add_top_logprobs(lp);
}

}  // namespace fluxion::proto
