#include "cluster/trace.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

int64_t Sample(const LengthDistribution& d, std::mt19937_64& rng) {
  double v = d.a;
  switch (d.kind) {
    case LengthDistribution::Kind::kFixed:
      break;
    case LengthDistribution::Kind::kUniform:
      v = std::uniform_int_distribution<int64_t>(static_cast<int64_t>(d.a),
                                                 static_cast<int64_t>(d.b))(rng);
      break;
    case LengthDistribution::Kind::kNormal:
      v = std::normal_distribution<double>(d.a, d.b)(rng);
      break;
    case LengthDistribution::Kind::kExponential:
      v = std::exponential_distribution<double>(1.0 / d.a)(rng);
      break;
  }
  return std::max<int64_t>(1, std::llround(v));
}

}  // namespace

absl::StatusOr<Schedule> LoadMooncakeTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace '", path, "'"));
  Schedule schedule;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_number, ": ", why));
    };
    if (!j.is_object()) return bad("not a JSON object");
    if (!j.contains("timestamp") || !j["timestamp"].is_number()) return bad("no numeric timestamp");
    if (!j.contains("input_length") || !j["input_length"].is_number_integer()) {
      return bad("no integer input_length");
    }
    if (!j.contains("output_length") || !j["output_length"].is_number_integer()) {
      return bad("no integer output_length");
    }
    TraceRequest r;
    r.arrival_s = j["timestamp"].get<double>() / 1000.0;
    r.input_tokens = j["input_length"].get<int64_t>();
    r.output_tokens = j["output_length"].get<int64_t>();
    if (r.input_tokens < 1 || r.output_tokens < 1) return bad("lengths must be at least 1");
    if (j.contains("hash_ids")) {
      if (!j["hash_ids"].is_array()) return bad("hash_ids is not an array");
      for (const auto& id : j["hash_ids"]) {
        // Unsigned 64-bit: hash ids can exceed 2^32 (a truncation bug class in other replayers).
        if (!id.is_number_integer()) return bad("hash_ids holds a non-integer");
        r.hash_ids.push_back(id.get<uint64_t>());
      }
    }
    r.source_index = line_number - 1;
    schedule.requests.push_back(std::move(r));
  }
  std::stable_sort(schedule.requests.begin(), schedule.requests.end(),
                   [](const TraceRequest& a, const TraceRequest& b) {
                     return a.arrival_s < b.arrival_s;
                   });
  return schedule;
}

absl::StatusOr<LengthDistribution> ParseLengthDistribution(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  LengthDistribution d;
  d.text = text;
  std::vector<double> args;
  for (size_t i = 1; i < parts.size(); ++i) {
    double v;
    if (!absl::SimpleAtod(parts[i], &v)) {
      return absl::InvalidArgumentError(absl::StrCat("length '", text, "': bad number '", parts[i],
                                                     "'"));
    }
    args.push_back(v);
  }
  auto want = [&](size_t n, const char* form) -> absl::Status {
    if (args.size() != n) {
      return absl::InvalidArgumentError(absl::StrCat("length '", text, "': expected ", form));
    }
    return absl::OkStatus();
  };
  absl::Status s;
  if (parts[0] == "fixed") {
    s = want(1, "fixed:N");
    d.kind = LengthDistribution::Kind::kFixed;
  } else if (parts[0] == "uniform") {
    s = want(2, "uniform:MIN:MAX");
    d.kind = LengthDistribution::Kind::kUniform;
  } else if (parts[0] == "normal") {
    s = want(2, "normal:MEAN:STD");
    d.kind = LengthDistribution::Kind::kNormal;
  } else if (parts[0] == "exponential") {
    s = want(1, "exponential:MEAN");
    d.kind = LengthDistribution::Kind::kExponential;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "length '", text, "': use fixed:N, uniform:MIN:MAX, normal:MEAN:STD or exponential:MEAN"));
  }
  if (!s.ok()) return s;
  d.a = args[0];
  d.b = args.size() > 1 ? args[1] : 0;
  if (d.a < 1 || (d.kind == LengthDistribution::Kind::kUniform && d.b < d.a) ||
      (d.kind == LengthDistribution::Kind::kNormal && d.b < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("length '", text, "': out of range"));
  }
  return d;
}

Schedule MakeSyntheticSchedule(const SyntheticOptions& options) {
  std::mt19937_64 rng(options.seed);
  Schedule schedule;
  double t = 0;
  for (int64_t i = 0; i < options.num_requests; ++i) {
    if (options.rate > 0 && i > 0) t += std::exponential_distribution<double>(options.rate)(rng);
    TraceRequest r;
    r.arrival_s = t;
    r.input_tokens = Sample(options.input, rng);
    r.output_tokens = Sample(options.output, rng);
    r.source_index = i;
    schedule.requests.push_back(std::move(r));
  }
  return schedule;
}

absl::StatusOr<Schedule> ApplyTransform(const Schedule& schedule, const TraceTransform& t,
                                        TransformReport* report) {
  if (!(t.time_scale > 0) || !(t.length_scale > 0)) {
    return absl::InvalidArgumentError("time and length scales must be positive");
  }
  if (!(t.sample_fraction > 0 && t.sample_fraction <= 1)) {
    return absl::InvalidArgumentError("sample fraction must be in (0, 1]");
  }
  TransformReport r;
  r.requests_in = schedule.requests.size();
  if (!schedule.requests.empty()) {
    r.span_in_s = schedule.requests.back().arrival_s - schedule.requests.front().arrival_s;
  }
  Schedule out;
  out.block_tokens =
      std::max<int64_t>(1, std::llround(static_cast<double>(schedule.block_tokens) * t.length_scale));
  std::mt19937_64 rng(t.seed);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  for (const TraceRequest& in : schedule.requests) {
    if (in.arrival_s < t.start_s) continue;
    if (t.duration_s > 0 && in.arrival_s > t.start_s + t.duration_s) continue;
    // Draw for every request in the window, kept or not, so the same seed keeps the same set.
    if (t.sample_fraction < 1 && coin(rng) >= t.sample_fraction) continue;
    if (t.max_requests > 0 && static_cast<int64_t>(out.requests.size()) >= t.max_requests) break;
    TraceRequest req = in;
    req.arrival_s = (in.arrival_s - t.start_s) * t.time_scale;
    req.input_tokens = std::max<int64_t>(
        1, std::llround(static_cast<double>(in.input_tokens) * t.length_scale));
    req.output_tokens = std::max<int64_t>(
        1, std::llround(static_cast<double>(in.output_tokens) * t.length_scale));
    if (t.max_input_tokens > 0 && req.input_tokens > t.max_input_tokens) {
      req.input_tokens = t.max_input_tokens;
      ++r.inputs_capped;
    }
    if (t.max_output_tokens > 0 && req.output_tokens > t.max_output_tokens) {
      req.output_tokens = t.max_output_tokens;
      ++r.outputs_capped;
    }
    // Blocks past the (scaled, capped) prompt would name no tokens.
    size_t blocks = (req.input_tokens + out.block_tokens - 1) / out.block_tokens;
    if (req.hash_ids.size() > blocks) req.hash_ids.resize(blocks);
    out.requests.push_back(std::move(req));
  }
  // Re-base so the first kept request starts the run.
  if (!out.requests.empty()) {
    double first = out.requests.front().arrival_s;
    for (TraceRequest& req : out.requests) req.arrival_s -= first;
    r.span_out_s = out.requests.back().arrival_s;
  }
  r.requests_out = out.requests.size();
  if (report != nullptr) *report = r;
  return out;
}

std::vector<uint32_t> BuildPrompt(const TraceRequest& request, int64_t block_tokens,
                                  uint32_t vocab_size) {
  std::vector<uint32_t> tokens;
  tokens.reserve(request.input_tokens);
  const uint32_t range = vocab_size - 1;
  for (size_t block = 0; block < request.hash_ids.size(); ++block) {
    uint64_t seed = SplitMix64(request.hash_ids[block]);
    for (int64_t i = 0; i < block_tokens && static_cast<int64_t>(tokens.size()) < request.input_tokens;
         ++i) {
      tokens.push_back(1 + static_cast<uint32_t>(SplitMix64(seed + i) % range));
    }
  }
  // Tokens beyond the named blocks belong to this request alone: a different salt keeps them out
  // of the hash-id space.
  uint64_t own = SplitMix64(0x5eed5eed5eed5eedULL ^ SplitMix64(request.source_index));
  while (static_cast<int64_t>(tokens.size()) < request.input_tokens) {
    tokens.push_back(1 + static_cast<uint32_t>(SplitMix64(own + tokens.size()) % range));
  }
  return tokens;
}

}  // namespace fluxion::cluster
