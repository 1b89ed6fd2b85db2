#include "cluster/trace.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <utility>

#include "absl/status/status.h"
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
  // Clamped in double first: llround of a value beyond int64 is undefined (and returned INT64_MIN,
  // which became a 1-token prompt). NaN cannot occur: the parameters are finite.
  return std::llround(std::clamp(v, 1.0, static_cast<double>(kMaxReplayTokens)));
}

template <typename T>
absl::Status OutOfRange(absl::string_view flag, T value, absl::string_view range) {
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " must be ", range, ", got ", value));
}

bool FiniteIn(double v, double lo, double hi) { return std::isfinite(v) && v >= lo && v <= hi; }

// Bounds the nesting of a record: nlohmann's parser is iterative, but its dump() and comparisons
// recurse, and a Mooncake record nests two levels (object, hash_ids).
class DepthLimit : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return ++depth_ <= kMaxTraceJsonDepth; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return --depth_, true; }
  bool start_array(std::size_t) override { return ++depth_ <= kMaxTraceJsonDepth; }
  bool end_array() override { return --depth_, true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception&) override {
    return false;
  }

 private:
  int depth_ = 0;
};

// A non-negative integer field of at most `limit`; `name` is the field for errors.
absl::StatusOr<int64_t> LengthField(const nlohmann::json& j, const char* name, int64_t limit) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat("no integer ", name));
  }
  if (it->is_number_unsigned() ? it->get<uint64_t>() > static_cast<uint64_t>(limit)
                               : it->get<int64_t>() > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " ", it->dump(), " is above the limit of ", limit));
  }
  const int64_t value = it->get<int64_t>();
  if (value < 1) return absl::InvalidArgumentError(absl::StrCat(name, " must be at least 1"));
  return value;
}

}  // namespace

absl::StatusOr<TraceRequest> ParseMooncakeRecord(absl::string_view line, absl::string_view where) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", why));
  };
  DepthLimit depth;
  if (!nlohmann::json::sax_parse(line.begin(), line.end(), &depth)) {
    return bad(absl::StrCat("not valid JSON (or nested deeper than ", kMaxTraceJsonDepth,
                            " levels)"));
  }
  nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr,
                                           /*allow_exceptions=*/false);
  if (!j.is_object()) return bad("not a JSON object");
  auto ts = j.find("timestamp");
  if (ts == j.end() || !ts->is_number()) return bad("no numeric timestamp");
  const double timestamp_ms = ts->get<double>();
  if (!FiniteIn(timestamp_ms, 0, kMaxReplayArrivalS * 1000)) {
    return bad(absl::StrCat("timestamp ", timestamp_ms, " must be in [0, ",
                            kMaxReplayArrivalS * 1000, "] ms"));
  }
  TraceRequest r;
  r.arrival_s = timestamp_ms / 1000.0;
  absl::StatusOr<int64_t> input = LengthField(j, "input_length", kMaxReplayTokens);
  if (!input.ok()) return bad(input.status().message());
  absl::StatusOr<int64_t> output = LengthField(j, "output_length", kMaxReplayTokens);
  if (!output.ok()) return bad(output.status().message());
  r.input_tokens = *input;
  r.output_tokens = *output;
  auto ids = j.find("hash_ids");
  if (ids != j.end()) {
    if (!ids->is_array()) return bad("hash_ids is not an array");
    // Each id names at least one prompt token.
    if (ids->size() > static_cast<size_t>(r.input_tokens)) {
      return bad(absl::StrCat("hash_ids lists ", ids->size(), " blocks for ", r.input_tokens,
                              " input tokens"));
    }
    r.hash_ids.reserve(ids->size());
    for (const auto& id : *ids) {
      // Unsigned 64-bit: hash ids can exceed 2^32 (a truncation bug class in other replayers).
      if (!id.is_number_integer()) return bad("hash_ids holds a non-integer");
      if (!id.is_number_unsigned() && id.get<int64_t>() < 0) {
        return bad("hash_ids holds a negative id");
      }
      r.hash_ids.push_back(id.get<uint64_t>());
    }
  }
  return r;
}

absl::StatusOr<Schedule> LoadMooncakeTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace '", path, "'"));
  Schedule schedule;
  // getline into a bounded buffer: std::getline would grow a string to the size of a file with
  // no newline.
  std::vector<char> buffer(kMaxTraceLineBytes + 1);
  int64_t line_number = 0;
  while (true) {
    in.getline(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const std::streamsize got = in.gcount();
    if (got == 0 && !in) break;  // end of file
    ++line_number;
    if (in.fail() && !in.eof()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_number,
                                                     ": line is longer than the limit of ",
                                                     kMaxTraceLineBytes, " bytes"));
    }
    // gcount counts the newline getline consumed; the last line (at end of file) has none.
    const absl::string_view line(buffer.data(), static_cast<size_t>(in.eof() ? got : got - 1));
    if (line.find_first_not_of(" \t\r") != absl::string_view::npos) {
      if (static_cast<int64_t>(schedule.requests.size()) >= kMaxReplayRequests) {
        return absl::InvalidArgumentError(absl::StrCat(path, ":", line_number, ": more than ",
                                                       kMaxReplayRequests,
                                                       " requests in one trace"));
      }
      absl::StatusOr<TraceRequest> r =
          ParseMooncakeRecord(line, absl::StrCat(path, ":", line_number));
      if (!r.ok()) return r.status();
      r->source_index = line_number - 1;
      schedule.requests.push_back(std::move(*r));
    }
    if (in.eof()) break;
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading trace '", path, "'"));
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
  const double max = static_cast<double>(kMaxReplayTokens);
  // uniform_int_distribution needs integral bounds; the others take any real in range.
  const bool integral = d.kind != LengthDistribution::Kind::kUniform ||
                        (d.a == std::floor(d.a) && d.b == std::floor(d.b));
  if (!FiniteIn(d.a, 1, max) || !FiniteIn(d.b, 0, max) || !integral ||
      (d.kind == LengthDistribution::Kind::kUniform && d.b < d.a)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "length '", text, "': out of range (lengths are in [1, ", kMaxReplayTokens,
        "], uniform bounds are integers with MIN <= MAX, STD is in [0, ", kMaxReplayTokens,
        "])"));
  }
  return d;
}

absl::Status ValidateSyntheticOptions(const SyntheticOptions& options) {
  if (options.num_requests < 1 || options.num_requests > kMaxReplayRequests) {
    return OutOfRange("--num-requests", options.num_requests,
                      absl::StrCat("in [1, ", kMaxReplayRequests, "]"));
  }
  if (!FiniteIn(options.rate, 0, 1e6)) return OutOfRange("--rate", options.rate, "in [0, 1e6]");
  if (options.distinct_prompts < 0 || options.distinct_prompts > kMaxReplayRequests) {
    return OutOfRange("--distinct-prompts", options.distinct_prompts,
                      absl::StrCat("in [0, ", kMaxReplayRequests, "] (0 = every prompt its own)"));
  }
  return absl::OkStatus();
}

Schedule MakeSyntheticSchedule(const SyntheticOptions& options) {
  std::mt19937_64 rng(options.seed);
  // The shared prompts' lengths come first, from the same generator; with none, the draws are
  // what they were before repeated prompts existed (same seed, same schedule).
  std::vector<std::pair<int64_t, int64_t>> prompts;  // (input, output) tokens
  for (int64_t k = 0; k < options.distinct_prompts; ++k) {
    int64_t input = Sample(options.input, rng);
    prompts.emplace_back(input, Sample(options.output, rng));
  }
  Schedule schedule;
  double t = 0;
  for (int64_t i = 0; i < options.num_requests; ++i) {
    if (options.rate > 0 && i > 0) t += std::exponential_distribution<double>(options.rate)(rng);
    TraceRequest r;
    r.arrival_s = t;
    if (prompts.empty()) {
      r.input_tokens = Sample(options.input, rng);
      r.output_tokens = Sample(options.output, rng);
      r.source_index = i;
    } else {
      const int64_t k = std::uniform_int_distribution<int64_t>(
          0, static_cast<int64_t>(prompts.size()) - 1)(rng);
      r.input_tokens = prompts[k].first;
      r.output_tokens = prompts[k].second;
      r.source_index = k;
    }
    schedule.requests.push_back(std::move(r));
  }
  return schedule;
}

absl::Status ValidateTraceTransform(const TraceTransform& t) {
  const std::string scale_range = absl::StrCat("in (0, ", kMaxReplayScale, "]");
  if (!FiniteIn(t.time_scale, 0, kMaxReplayScale) || t.time_scale == 0) {
    return OutOfRange("--time-scale", t.time_scale, scale_range);
  }
  if (!FiniteIn(t.length_scale, 0, kMaxReplayScale) || t.length_scale == 0) {
    return OutOfRange("--length-scale", t.length_scale, scale_range);
  }
  if (!(t.sample_fraction > 0 && t.sample_fraction <= 1)) {
    return OutOfRange("--sample", t.sample_fraction, "in (0, 1]");
  }
  const std::string token_range = absl::StrCat("in [0, ", kMaxReplayTokens, "] (0 = no cap)");
  if (t.max_input_tokens < 0 || t.max_input_tokens > kMaxReplayTokens) {
    return OutOfRange("--max-input-tokens", t.max_input_tokens, token_range);
  }
  if (t.max_output_tokens < 0 || t.max_output_tokens > kMaxReplayTokens) {
    return OutOfRange("--max-output-tokens", t.max_output_tokens,
                      token_range);
  }
  if (t.max_requests < 0 || t.max_requests > kMaxReplayRequests) {
    return OutOfRange("--max-requests", t.max_requests,
                      absl::StrCat("in [0, ", kMaxReplayRequests, "] (0 = all)"));
  }
  const std::string time_range = absl::StrCat("in [0, ", kMaxReplayArrivalS, "] s");
  if (!FiniteIn(t.start_s, 0, kMaxReplayArrivalS)) {
    return OutOfRange("--start-s", t.start_s, time_range);
  }
  if (!FiniteIn(t.duration_s, 0, kMaxReplayArrivalS)) {
    return OutOfRange("--duration-s", t.duration_s, time_range);
  }
  return absl::OkStatus();
}

absl::StatusOr<Schedule> ApplyTransform(const Schedule& schedule, const TraceTransform& t,
                                        TransformReport* report) {
  if (absl::Status valid = ValidateTraceTransform(t); !valid.ok()) return valid;
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
    // Scaled in double and checked before rounding: llround of a value beyond int64 is undefined
    // (it gave INT64_MIN, which became a 1-token prompt).
    double input = std::max(1.0, std::round(static_cast<double>(in.input_tokens) * t.length_scale));
    double output =
        std::max(1.0, std::round(static_cast<double>(in.output_tokens) * t.length_scale));
    if (t.max_input_tokens > 0 && input > t.max_input_tokens) {
      input = t.max_input_tokens;
      ++r.inputs_capped;
    }
    if (t.max_output_tokens > 0 && output > t.max_output_tokens) {
      output = t.max_output_tokens;
      ++r.outputs_capped;
    }
    const double limit = static_cast<double>(kMaxReplayTokens);
    if (!(input <= limit) || !(output <= limit) || !(req.arrival_s <= kMaxReplayArrivalS)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request from trace line / draw ", in.source_index + 1, ": after --length-scale ",
          t.length_scale, " and --time-scale ", t.time_scale, " it has ", input, " input and ",
          output, " output tokens at ", req.arrival_s, " s; the limits are ", kMaxReplayTokens,
          " tokens (cap with --max-input-tokens / --max-output-tokens) and ", kMaxReplayArrivalS,
          " s"));
    }
    req.input_tokens = static_cast<int64_t>(input);
    req.output_tokens = static_cast<int64_t>(output);
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
  // The REQUIRES of the header, kept safe for a caller that ignores it: range 0 divided by zero.
  vocab_size = std::max<uint32_t>(vocab_size, 2);
  block_tokens = std::max<int64_t>(block_tokens, 1);
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
