#include "cluster/openai_request.h"

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/json_text.h"
#include "model/stream_detokenizer.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {
namespace {

using Json = nlohmann::json;

constexpr char kParamPayload[] = "type.fluxion.dev/openai.param";
constexpr char kCodePayload[] = "type.fluxion.dev/openai.code";

absl::Status Invalid(absl::string_view param, absl::string_view message) {
  return WithParam(absl::InvalidArgumentError(message), param);
}

// Names of the JSON types, for messages ("max_tokens must be an integer, got string").
std::string TypeName(const Json& v) { return v.type_name(); }

absl::StatusOr<uint64_t> UnsignedField(const std::string& name, const Json& v, uint64_t min,
                                       uint64_t max) {
  if (!v.is_number_integer()) {
    return Invalid(name, absl::StrCat(name, " must be an integer, got ", TypeName(v)));
  }
  if (v.is_number_unsigned()) {
    uint64_t x = v.get<uint64_t>();
    if (x >= min && x <= max) return x;
  } else {
    int64_t x = v.get<int64_t>();
    if (x >= 0 && static_cast<uint64_t>(x) >= min && static_cast<uint64_t>(x) <= max) {
      return static_cast<uint64_t>(x);
    }
  }
  return Invalid(name, absl::StrCat(name, " must be in [", min, ", ", max, "], got ", v.dump()));
}

absl::StatusOr<float> NumberField(const std::string& name, const Json& v) {
  if (!v.is_number()) {
    return Invalid(name, absl::StrCat(name, " must be a number, got ", TypeName(v)));
  }
  double x = v.get<double>();
  if (!std::isfinite(x)) return Invalid(name, absl::StrCat(name, " must be finite"));
  return static_cast<float>(x);
}

// A field that Fluxion cannot honour except at the value that means "off": accepted there,
// refused otherwise with why.
absl::Status OnlyDefault(const std::string& name, const Json& v, bool is_default,
                         absl::string_view why) {
  if (v.is_null() || is_default) return absl::OkStatus();
  return WithParam(absl::InvalidArgumentError(absl::StrCat(name, " is not supported: ", why)),
                   name);
}

absl::StatusOr<std::vector<std::string>> StopStrings(const Json& v) {
  std::vector<std::string> stop;
  if (v.is_null()) return stop;
  if (v.is_string()) {
    stop.push_back(v.get<std::string>());
  } else if (v.is_array()) {
    for (const Json& s : v) {
      if (!s.is_string()) return Invalid("stop", "stop must be a string or an array of strings");
      stop.push_back(s.get<std::string>());
    }
  } else {
    return Invalid("stop", "stop must be a string or an array of strings");
  }
  if (stop.size() > model::kMaxStopStrings) {
    return Invalid("stop", absl::StrCat("stop holds ", stop.size(), " strings; at most ",
                                        model::kMaxStopStrings));
  }
  for (const std::string& s : stop) {
    if (s.empty()) return Invalid("stop", "stop strings must not be empty");
    if (s.size() > model::kMaxStopStringBytes) {
      return Invalid("stop", absl::StrCat("a stop string is ", s.size(), " bytes; at most ",
                                          model::kMaxStopStringBytes));
    }
  }
  return stop;
}

absl::StatusOr<std::vector<uint32_t>> TokenIds(const std::string& name, const Json& v, size_t max) {
  std::vector<uint32_t> ids;
  if (!v.is_array()) return Invalid(name, absl::StrCat(name, " must be an array of token ids"));
  if (v.size() > max) {
    return Invalid(name, absl::StrCat(name, " holds ", v.size(), " ids; at most ", max));
  }
  ids.reserve(v.size());
  for (const Json& id : v) {
    auto x = UnsignedField(name, id, 0, std::numeric_limits<uint32_t>::max());
    if (!x.ok()) return x.status();
    ids.push_back(static_cast<uint32_t>(*x));
  }
  return ids;
}

// One prompt: a non-empty string, or a non-empty array of token ids.
absl::StatusOr<Prompt> ParseOnePrompt(const Json& p, const ParseLimits& limits) {
  Prompt out;
  if (p.is_string()) {
    out.text = p.get<std::string>();
    if (out.text->empty()) return Invalid("prompt", "prompt must not be empty");
    return out;
  }
  if (p.is_array() && !p.empty() && p[0].is_number()) {
    auto ids = TokenIds("prompt", p, limits.max_prompt_ids);
    if (!ids.ok()) return ids.status();
    out.ids = std::move(*ids);
    return out;
  }
  return Invalid("prompt", "prompt must be a non-empty string or an array of token ids");
}

// "prompt": one prompt, or a non-empty array of prompts (strings, or arrays of ids).
absl::Status ParsePrompt(const Json& v, const ParseLimits& limits, Request* r) {
  const bool several = v.is_array() && !v.empty() && (v[0].is_string() || v[0].is_array());
  if (!several) {
    auto one = ParseOnePrompt(v, limits);
    if (!one.ok()) return one.status();
    r->prompts = {*std::move(one)};
    return absl::OkStatus();
  }
  if (v.size() > limits.max_choices) {
    return Invalid("prompt", absl::StrCat("prompt holds ", v.size(), " prompts; at most ",
                                          limits.max_choices, " per request"));
  }
  r->prompts.clear();
  for (const Json& p : v) {
    auto one = ParseOnePrompt(p, limits);
    if (!one.ok()) return one.status();
    r->prompts.push_back(*std::move(one));
  }
  return absl::OkStatus();
}

absl::StatusOr<Message> ParseMessage(const Json& m, size_t index) {
  const std::string where = absl::StrCat("messages[", index, "]");
  if (!m.is_object()) return Invalid("messages", absl::StrCat(where, " must be an object"));
  Message out;
  bool has_role = false, has_content = false;
  for (const auto& [key, v] : m.items()) {
    if (key == "role") {
      if (!v.is_string()) return Invalid("messages", absl::StrCat(where, ".role must be a string"));
      out.role = v.get<std::string>();
      // OpenAI's newer name for the system role; the chat templates know only `system`.
      if (out.role == "developer") out.role = "system";
      has_role = true;
    } else if (key == "content") {
      has_content = true;
      if (v.is_string()) {
        out.content = v.get<std::string>();
      } else if (v.is_array()) {
        // Content parts: text only (no images or audio in a text model).
        for (const Json& part : v) {
          if (!part.is_object() || part.size() != 2 || !part.contains("type") ||
              part["type"] != "text" || !part.contains("text") || !part["text"].is_string()) {
            return Invalid("messages", absl::StrCat(where,
                                                    ".content: only {\"type\": \"text\", \"text\": "
                                                    "...} parts are supported"));
          }
          out.content += part["text"].get<std::string>();
        }
      } else {
        return Invalid("messages",
                       absl::StrCat(where, ".content must be a string or an array of text parts"));
      }
    } else if (key == "name") {
      // A participant's name: passed to the chat template, which renders it or not.
      if (!v.is_null() && !v.is_string()) {
        return Invalid("messages", absl::StrCat(where, ".name must be a string"));
      }
      if (v.is_string()) out.name = v.get<std::string>();
    } else {
      return Invalid("messages", absl::StrCat(where, ".", key, " is not supported"));
    }
  }
  if (!has_role) return Invalid("messages", absl::StrCat(where, " has no role"));
  if (!has_content) return Invalid("messages", absl::StrCat(where, " has no content"));
  return out;
}

absl::Status ParseMessages(const Json& v, const ParseLimits& limits, Request* r) {
  if (!v.is_array() || v.empty()) {
    return Invalid("messages", "messages must be a non-empty array");
  }
  if (v.size() > limits.max_messages) {
    return Invalid("messages", absl::StrCat("messages holds ", v.size(), " entries; at most ",
                                            limits.max_messages));
  }
  for (size_t i = 0; i < v.size(); ++i) {
    auto m = ParseMessage(v[i], i);
    if (!m.ok()) return m.status();
    r->messages.push_back(std::move(*m));
  }
  return absl::OkStatus();
}

using FieldParser = std::function<absl::Status(const Json&, Request*)>;

using FieldTable = std::map<std::string, FieldParser>;

// Chat's two logprobs fields, read apart and joined once the body is parsed.
struct ChatLogprobs {
  bool on = false;
  std::optional<uint32_t> top;
};

// The sampling fields both endpoints take: model, max_tokens, temperature, top_p, top_k, seed,
// stop, stop_token_ids.
void AddSamplingFields(const ParseLimits& limits, FieldTable* table) {
  FieldTable& f = *table;
  f["model"] = [](const Json& v, Request* r) {
    if (!v.is_string()) return Invalid("model", "model must be a string");
    r->model = v.get<std::string>();
    return absl::OkStatus();
  };
  f["max_tokens"] = [](const Json& v, Request* r) -> absl::Status {
    if (v.is_null()) return absl::OkStatus();
    auto x = UnsignedField("max_tokens", v, 1, std::numeric_limits<uint32_t>::max());
    if (!x.ok()) return x.status();
    r->max_tokens = static_cast<uint32_t>(*x);
    return absl::OkStatus();
  };
  f["temperature"] = [](const Json& v, Request* r) -> absl::Status {
    if (v.is_null()) return absl::OkStatus();
    auto x = NumberField("temperature", v);
    if (!x.ok()) return x.status();
    if (*x < 0) return Invalid("temperature", "temperature must be >= 0");
    r->temperature = *x;
    return absl::OkStatus();
  };
  f["top_p"] = [](const Json& v, Request* r) -> absl::Status {
    if (v.is_null()) return absl::OkStatus();
    auto x = NumberField("top_p", v);
    if (!x.ok()) return x.status();
    if (!(*x > 0 && *x <= 1)) return Invalid("top_p", "top_p must be in (0, 1]");
    r->top_p = *x;
    return absl::OkStatus();
  };
  f["top_k"] = [](const Json& v, Request* r) -> absl::Status {
    if (v.is_null()) return absl::OkStatus();
    // -1 is vLLM's spelling of "off", as 0 is ours.
    if (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() == -1) {
      r->top_k = 0;
      return absl::OkStatus();
    }
    auto x = UnsignedField("top_k", v, 0, std::numeric_limits<uint32_t>::max());
    if (!x.ok()) return x.status();
    r->top_k = static_cast<uint32_t>(*x);
    return absl::OkStatus();
  };
  f["seed"] = [](const Json& v, Request* r) -> absl::Status {
    if (v.is_null()) return absl::OkStatus();
    auto x = UnsignedField("seed", v, 0, std::numeric_limits<uint64_t>::max());
    if (!x.ok()) return x.status();
    r->seed = *x;
    return absl::OkStatus();
  };
  f["stop"] = [](const Json& v, Request* r) -> absl::Status {
    auto stop = StopStrings(v);
    if (!stop.ok()) return stop.status();
    r->stop = std::move(*stop);
    return absl::OkStatus();
  };
  f["stop_token_ids"] = [limits](const Json& v, Request* r) -> absl::Status {
    if (v.is_null()) return absl::OkStatus();
    auto ids = TokenIds("stop_token_ids", v, limits.max_stop_token_ids);
    if (!ids.ok()) return ids.status();
    r->stop_token_ids = std::move(*ids);
    return absl::OkStatus();
  };
}

// n and the streaming fields.
void AddStreamingFields(const ParseLimits& limits, FieldTable* table) {
  FieldTable& f = *table;
  f["n"] = [limits](const Json& v, Request* r) -> absl::Status {
    if (v.is_null()) return absl::OkStatus();
    auto x = UnsignedField("n", v, 1, limits.max_choices);
    if (!x.ok()) return x.status();
    r->n = static_cast<uint32_t>(*x);
    return absl::OkStatus();
  };
  f["stream"] = [](const Json& v, Request* r) {
    if (v.is_null()) return absl::OkStatus();
    if (!v.is_boolean()) return Invalid("stream", "stream must be a boolean");
    r->stream = v.get<bool>();
    return absl::OkStatus();
  };
  f["stream_options"] = [](const Json& v, Request* r) {
    if (v.is_null()) return absl::OkStatus();
    if (!v.is_object()) return Invalid("stream_options", "stream_options must be an object");
    for (const auto& [key, x] : v.items()) {
      if (key != "include_usage") {
        return Invalid("stream_options", absl::StrCat("stream_options.", key, " is not supported"));
      }
      if (!x.is_boolean()) {
        return Invalid("stream_options", "stream_options.include_usage must be a boolean");
      }
      r->include_usage = x.get<bool>();
    }
    return absl::OkStatus();
  };
}

// OpenAI's presence / frequency penalty: a number in [-2, 2] (null: 0).
absl::Status PenaltyField(const std::string& name, const Json& v, float* out) {
  if (v.is_null()) return absl::OkStatus();
  auto x = NumberField(name, v);
  if (!x.ok()) return x.status();
  if (*x < -2 || *x > 2) {
    return Invalid(name, absl::StrCat(name, " must be in [-2, 2], got ", v.dump()));
  }
  *out = *x;
  return absl::OkStatus();
}

absl::Status BoolField(const std::string& name, const Json& v, bool* out) {
  if (v.is_null()) return absl::OkStatus();
  if (!v.is_boolean()) return Invalid(name, absl::StrCat(name, " must be a boolean"));
  *out = v.get<bool>();
  return absl::OkStatus();
}

// "fluxion": {"policy": NAME, "budget": FRACTION}, both optional. The decode node checks the name
// and whether the policy takes a budget (INVALID_ARGUMENT naming them).
absl::Status ParseFluxionExtension(const Json& v, Request* r) {
  if (v.is_null()) return absl::OkStatus();
  if (!v.is_object()) return Invalid("fluxion", "fluxion must be an object");
  for (const auto& [key, value] : v.items()) {
    if (key == "policy") {
      if (!value.is_string() || value.get<std::string>().empty() ||
          value.get<std::string>().size() > 64) {
        return Invalid("fluxion", "fluxion.policy must be a policy name (docs/SPARSE.md)");
      }
      r->policy = value.get<std::string>();
    } else if (key == "budget") {
      auto x = NumberField("fluxion.budget", value);
      if (!x.ok()) return WithParam(x.status(), "fluxion");
      if (!(*x > 0 && *x <= 1)) return Invalid("fluxion", "fluxion.budget must be in (0, 1]");
      r->budget = *x;
    } else {
      return Invalid("fluxion", absl::StrCat("fluxion.", key,
                                             " is not supported (fluxion takes policy, budget)"));
    }
  }
  return absl::OkStatus();
}

// vLLM's and Fluxion's extensions, and OpenAI's penalties, both endpoints take.
void AddExtensionFields(FieldTable* table) {
  FieldTable& f = *table;
  f["ignore_eos"] = [](const Json& v, Request* r) {
    return BoolField("ignore_eos", v, &r->ignore_eos);
  };
  f["include_stop_str_in_output"] = [](const Json& v, Request* r) {
    return BoolField("include_stop_str_in_output", v, &r->include_stop_str_in_output);
  };
  f["skip_special_tokens"] = [](const Json& v, Request* r) {
    return BoolField("skip_special_tokens", v, &r->skip_special_tokens);
  };
  f["fluxion"] = ParseFluxionExtension;
  f["min_tokens"] = [](const Json& v, Request* r) {
    if (v.is_null()) return absl::OkStatus();
    auto x = UnsignedField("min_tokens", v, 0, std::numeric_limits<uint32_t>::max());
    if (!x.ok()) return x.status();
    r->min_tokens = static_cast<uint32_t>(*x);
    return absl::OkStatus();
  };
  f["repetition_penalty"] = [](const Json& v, Request* r) {
    if (v.is_null()) return absl::OkStatus();
    auto x = NumberField("repetition_penalty", v);
    if (!x.ok()) return x.status();
    if (!(*x > 0)) return Invalid("repetition_penalty", "repetition_penalty must be > 0");
    r->repetition_penalty = *x;
    return absl::OkStatus();
  };
  f["frequency_penalty"] = [](const Json& v, Request* r) {
    return PenaltyField("frequency_penalty", v, &r->frequency_penalty);
  };
  f["presence_penalty"] = [](const Json& v, Request* r) {
    return PenaltyField("presence_penalty", v, &r->presence_penalty);
  };
}

// Fields accepted only at their defaults (or, for `user`, ignored).
void AddDefaultOnlyFields(FieldTable* table) {
  FieldTable& f = *table;
  // Accepted and deliberately ignored: OpenAI uses it for abuse monitoring, which has no
  // counterpart here; refusing it would break clients that always send it.
  f["user"] = [](const Json& v, Request*) {
    if (!v.is_null() && !v.is_string()) return Invalid("user", "user must be a string");
    return absl::OkStatus();
  };
  f["logit_bias"] = [](const Json& v, Request*) {
    return OnlyDefault("logit_bias", v, v.is_object() && v.empty(),
                       "the sampler takes no logit biases");
  };
}

// /v1/completions' own fields.
void AddCompletionsFields(const ParseLimits& limits, FieldTable* table) {
  FieldTable& f = *table;
  f["prompt"] = [limits](const Json& v, Request* r) { return ParsePrompt(v, limits, r); };
  f["logprobs"] = [](const Json& v, Request* r) {
    if (v.is_null()) return absl::OkStatus();
    auto x = UnsignedField("logprobs", v, 0, kMaxLogprobs);
    if (!x.ok()) return x.status();
    r->logprobs = static_cast<uint32_t>(*x);
    return absl::OkStatus();
  };
  f["echo"] = [](const Json& v, Request* r) { return BoolField("echo", v, &r->echo); };
  f["best_of"] = [](const Json& v, Request*) {
    return OnlyDefault("best_of", v, v == 1, "one sequence per request");
  };
  f["suffix"] = [](const Json& v, Request*) {
    return OnlyDefault("suffix", v, false, "no insertion (fill-in-the-middle) mode");
  };
}

// /v1/chat/completions' own fields; max_completion_tokens lands in `*max_completion_tokens`.
void AddChatFields(const ParseLimits& limits, std::optional<uint32_t>* max_completion_tokens,
                   ChatLogprobs* logprobs, FieldTable* table) {
  FieldTable& f = *table;
  f["messages"] = [limits](const Json& v, Request* r) { return ParseMessages(v, limits, r); };
  f["max_completion_tokens"] = [max_completion_tokens](const Json& v, Request*) {
    if (v.is_null()) return absl::OkStatus();
    auto x = UnsignedField("max_completion_tokens", v, 1, std::numeric_limits<uint32_t>::max());
    if (!x.ok()) return x.status();
    *max_completion_tokens = static_cast<uint32_t>(*x);
    return absl::OkStatus();
  };
  f["logprobs"] = [logprobs](const Json& v, Request*) {
    return BoolField("logprobs", v, &logprobs->on);
  };
  f["top_logprobs"] = [logprobs](const Json& v, Request*) {
    if (v.is_null()) return absl::OkStatus();
    auto x = UnsignedField("top_logprobs", v, 0, kMaxLogprobs);
    if (!x.ok()) return x.status();
    logprobs->top = static_cast<uint32_t>(*x);
    return absl::OkStatus();
  };
  f["chat_template_kwargs"] = [](const Json& v, Request* r) {
    if (v.is_null()) return absl::OkStatus();
    if (!v.is_object()) {
      return Invalid("chat_template_kwargs", "chat_template_kwargs must be an object");
    }
    r->chat_template_kwargs = v;
    return absl::OkStatus();
  };
  f["response_format"] = [](const Json& v, Request*) {
    return OnlyDefault("response_format", v,
                       v.is_object() && v.size() == 1 && v.value("type", "") == "text",
                       "only {\"type\": \"text\"} (no constrained decoding)");
  };
}

// The fields of one endpoint: name -> parser. Fields not in the table are refused.
FieldTable Fields(Endpoint endpoint, const ParseLimits& limits,
                  std::optional<uint32_t>* max_completion_tokens, ChatLogprobs* chat_logprobs) {
  FieldTable f;
  AddSamplingFields(limits, &f);
  AddStreamingFields(limits, &f);
  AddDefaultOnlyFields(&f);
  AddExtensionFields(&f);
  if (endpoint == Endpoint::kCompletions) {
    AddCompletionsFields(limits, &f);
  } else {
    AddChatFields(limits, max_completion_tokens, chat_logprobs, &f);
  }
  return f;
}

}  // namespace

namespace {

// `status` with `value` under `key` (nothing when value is empty), and back.
absl::Status WithPayload(absl::Status status, absl::string_view key, absl::string_view value) {
  if (!value.empty()) status.SetPayload(key, absl::Cord(value));
  return status;
}
std::string PayloadOf(const absl::Status& status, absl::string_view key) {
  auto value = status.GetPayload(key);
  return value ? std::string(*value) : std::string();
}

}  // namespace

absl::Status WithParam(absl::Status status, absl::string_view param) {
  return WithPayload(std::move(status), kParamPayload, param);
}
std::string ErrorParam(const absl::Status& status) { return PayloadOf(status, kParamPayload); }
absl::Status WithCode(absl::Status status, absl::string_view code) {
  return WithPayload(std::move(status), kCodePayload, code);
}
std::string ErrorCode(const absl::Status& status) { return PayloadOf(status, kCodePayload); }

absl::StatusOr<Request> ParseRequest(Endpoint endpoint, absl::string_view body,
                                     const ParseLimits& limits) {
  model::JsonTextOptions options;
  options.max_depth = limits.max_depth;
  options.reject_duplicate_top_level_keys = true;
  auto json = model::ParseJsonText(body, "the request body", options);
  if (!json.ok()) return json.status();
  if (!json->is_object())
    return absl::InvalidArgumentError("the request body must be a JSON object");
  Request r;
  r.endpoint = endpoint;
  std::optional<uint32_t> max_completion_tokens;
  ChatLogprobs chat_logprobs;
  const auto fields = Fields(endpoint, limits, &max_completion_tokens, &chat_logprobs);
  for (const auto& [key, value] : json->items()) {
    auto it = fields.find(key);
    if (it == fields.end()) {
      return Invalid(key, absl::StrCat("Unrecognized request argument supplied: ", key,
                                       " (Fluxion refuses fields it would otherwise ignore)"));
    }
    if (absl::Status s = it->second(value, &r); !s.ok()) return s;
  }
  if (!json->contains("model")) return Invalid("model", "model is required");
  if (endpoint == Endpoint::kCompletions && !json->contains("prompt")) {
    return Invalid("prompt", "prompt is required");
  }
  if (endpoint == Endpoint::kChatCompletions && !json->contains("messages")) {
    return Invalid("messages", "messages is required");
  }
  if (max_completion_tokens) {
    if (r.max_tokens && *r.max_tokens != *max_completion_tokens) {
      return Invalid("max_completion_tokens",
                     "max_tokens and max_completion_tokens differ; give one of them");
    }
    r.max_tokens = max_completion_tokens;
  }
  if (chat_logprobs.top && !chat_logprobs.on) {
    return Invalid("top_logprobs", "top_logprobs needs logprobs set to true");
  }
  if (chat_logprobs.on) r.logprobs = chat_logprobs.top.value_or(0);
  if (endpoint == Endpoint::kCompletions && !r.max_tokens) {
    r.max_tokens = kDefaultCompletionMaxTokens;
  }
  if (r.min_tokens > 0 && r.max_tokens && r.min_tokens > *r.max_tokens) {
    return Invalid("min_tokens", absl::StrCat("min_tokens (", r.min_tokens,
                                              ") must be at most max_tokens (", *r.max_tokens,
                                              ")"));
  }
  if (r.prompts.size() * r.n > limits.max_choices) {
    return Invalid("n", absl::StrCat(r.prompts.size(), " prompts x n = ", r.n, " is ",
                                     r.prompts.size() * r.n, " choices; at most ",
                                     limits.max_choices, " per request"));
  }
  if (json->contains("stream_options") && !(*json)["stream_options"].is_null() && !r.stream) {
    return Invalid("stream_options", "stream_options is only allowed when stream is true");
  }
  return r;
}

}  // namespace fluxion::cluster::openai
