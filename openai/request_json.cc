#include "openai/request_json.h"

#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/sampling_params.h"

namespace infinigen::openai {
namespace {

using nlohmann::json;

struct Reader {
  const json& body;
  ApiError& error;

  bool Fail(const std::string& param, const std::string& message) {
    error.http_status = 400;
    error.param = param;
    error.message = message;
    return false;
  }
  const json* Get(const char* key) const {
    auto it = body.find(key);
    return it == body.end() || it->is_null() ? nullptr : &*it;
  }
  bool Number(const char* key, double lo, double hi, std::optional<double>& out) {
    const json* v = Get(key);
    if (v == nullptr) return true;
    if (!v->is_number()) return Fail(key, absl::StrCat("`", key, "` must be a number"));
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi)) {
      return Fail(key, absl::StrCat("`", key, "` must be in [", lo, ", ", hi, "], not ", x));
    }
    out = x;
    return true;
  }
  bool Integer(const char* key, int64_t lo, int64_t hi, std::optional<int64_t>& out) {
    const json* v = Get(key);
    if (v == nullptr) return true;
    if (!v->is_number_integer()) return Fail(key, absl::StrCat("`", key, "` must be an integer"));
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) {
      return Fail(key, absl::StrCat("`", key, "` must be in [", lo, ", ", hi, "], not ", x));
    }
    out = x;
    return true;
  }
  bool Bool(const char* key, std::optional<bool>& out) {
    const json* v = Get(key);
    if (v == nullptr) return true;
    if (!v->is_boolean()) return Fail(key, absl::StrCat("`", key, "` must be true or false"));
    out = v->get<bool>();
    return true;
  }
  // A field this server does not implement: refused unless absent or at its neutral value.
  bool Unsupported(const char* key, const json& neutral, const std::string& instead) {
    const json* v = Get(key);
    if (v == nullptr || *v == neutral) return true;
    return Fail(key, absl::StrCat("`", key, "` is not supported by this server", instead));
  }
};

// A request body as a JSON object; false with a 400 when it is none.
bool ParseObject(absl::string_view body, json& out, ApiError& error) {
  out = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (out.is_discarded() || !out.is_object()) {
    error.http_status = 400;
    error.message = "the body must be a JSON object";
    return false;
  }
  return true;
}

bool ParseStop(Reader& r, v1::StoppingCriteria& stopping) {
  const json* stop = r.Get("stop");
  if (stop == nullptr) return true;
  if (stop->is_string()) {
    stopping.add_stop_strings(stop->get<std::string>());
    return true;
  }
  if (!stop->is_array()) return r.Fail("stop", "`stop` must be a string or a list of strings");
  for (const json& s : *stop) {
    if (!s.is_string()) return r.Fail("stop", "`stop` must be a string or a list of strings");
    stopping.add_stop_strings(s.get<std::string>());
  }
  return true;
}

bool ParseTokenIds(const json& v, v1::TokenIds& ids) {
  for (const json& id : v) {
    if (!id.is_number_integer()) return false;
    const int64_t x = id.get<int64_t>();
    if (x < 0 || x > std::numeric_limits<int32_t>::max()) return false;
    ids.add_ids(static_cast<int32_t>(x));
  }
  return true;
}

// One prompt: a string or a list of token ids; false when `v` is neither.
bool ParseOnePrompt(const json& v, v1::GenerateRequest& req) {
  if (v.is_string()) {
    req.set_text(v.get<std::string>());
    return true;
  }
  return v.is_array() && !v.empty() && ParseTokenIds(v, *req.mutable_token_ids());
}

bool ParsePrompt(Reader& r, ParsedRequest& out) {
  const json* prompt = r.Get("prompt");
  if (prompt == nullptr) return r.Fail("prompt", "`prompt` is required");
  constexpr const char* kShapes =
      "`prompt` must be a string, a list of token ids, or a list of either (a batch of prompts)";
  if (prompt->is_string()) return ParseOnePrompt(*prompt, out.request);
  if (!prompt->is_array() || prompt->empty()) return r.Fail("prompt", kShapes);
  if ((*prompt)[0].is_number()) {
    if (!ParseOnePrompt(*prompt, out.request)) {
      return r.Fail("prompt", "`prompt` token ids must be integers in [0, 2^31)");
    }
    return true;
  }
  if (prompt->size() > static_cast<size_t>(kMaxPrompts)) {
    return r.Fail("prompt", absl::StrCat("a request lists at most ", kMaxPrompts, " prompts, not ",
                                         prompt->size(), " (send several requests)"));
  }
  std::vector<v1::GenerateRequest> batch(prompt->size());
  for (size_t i = 0; i < prompt->size(); ++i) {
    if (!ParseOnePrompt((*prompt)[i], batch[i])) {
      return r.Fail("prompt", absl::StrCat("`prompt[", i,
                                           "]` must be a string or a non-empty list of token ids "
                                           "(integers in [0, 2^31))"));
    }
  }
  if (batch.size() == 1) {
    out.request = std::move(batch[0]);
  } else {
    out.request = batch[0];
    out.batch = std::move(batch);
  }
  return true;
}

bool ParseMessages(Reader& r, v1::GenerateRequest& req) {
  const json* messages = r.Get("messages");
  if (messages == nullptr || !messages->is_array() || messages->empty()) {
    return r.Fail("messages", "`messages` must be a non-empty list of {role, content}");
  }
  v1::ChatMessages* out = req.mutable_messages();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string at = absl::StrCat("messages[", i, "]");
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return r.Fail(at, absl::StrCat("`", at, "` needs a string `role`"));
    }
    v1::ChatMessage* msg = out->add_messages();
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";  // OpenAI's newer name for system instructions
    msg->set_role(role);
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) continue;
    if (content->is_string()) {
      msg->set_content(content->get<std::string>());
      continue;
    }
    if (!content->is_array()) {
      return r.Fail(at + ".content", "`content` must be a string or a list of text parts");
    }
    std::string text;
    for (const json& part : *content) {
      // json::value() throws for a `type` of another JSON type: each field is checked first.
      auto type = part.is_object() ? part.find("type") : part.end();
      if (!part.is_object() || type == part.end() || !type->is_string() || *type != "text" ||
          !part.contains("text") || !part["text"].is_string()) {
        return r.Fail(
            at + ".content",
            "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported");
      }
      text += part["text"].get<std::string>();
    }
    msg->set_content(text);
  }
  return true;
}

// The vLLM / OpenAI sampling fields both endpoints share.
bool ParseSampling(Reader& r, ParsedRequest& out) {
  v1::GenerateRequest& req = out.request;
  v1::SamplingParams& sampling = *req.mutable_sampling();
  v1::StoppingCriteria& stopping = *req.mutable_stopping();
  std::optional<double> temperature, top_p, min_p, repetition, presence, frequency;
  std::optional<int64_t> seed, top_k, n, min_tokens, prompt_logprobs;
  std::optional<bool> ignore_eos, include_stop, skip_special;
  if (!r.Number("temperature", 0, 2, temperature) || !r.Number("top_p", 0, 1, top_p) ||
      !r.Number("min_p", 0, 1, min_p) || !r.Number("repetition_penalty", 0, 1e9, repetition) ||
      !r.Number("presence_penalty", -kMaxOpenAiPenalty, kMaxOpenAiPenalty, presence) ||
      !r.Number("frequency_penalty", -kMaxOpenAiPenalty, kMaxOpenAiPenalty, frequency) ||
      !r.Integer("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                 seed) ||
      !r.Integer("top_k", -1, std::numeric_limits<int32_t>::max(), top_k) ||
      !r.Integer("n", 1, std::numeric_limits<int32_t>::max(), n) ||
      !r.Integer("min_tokens", 0, std::numeric_limits<int32_t>::max(), min_tokens) ||
      !r.Integer("prompt_logprobs", 0, kMaxLogprobs, prompt_logprobs) ||
      !r.Bool("ignore_eos", ignore_eos) || !r.Bool("include_stop_str_in_output", include_stop) ||
      !r.Bool("skip_special_tokens", skip_special)) {
    return false;
  }
  if (n.has_value() && *n > kMaxSamples) {
    return r.Fail("n", absl::StrCat("`n` may be at most ", kMaxSamples));
  }
  out.n = static_cast<int>(n.value_or(1));
  if (!r.Unsupported("best_of", 1, "") || !r.Unsupported("suffix", "", "") ||
      !r.Unsupported("tools", json::array(), "") || !r.Unsupported("tool_choice", "none", "") ||
      !r.Unsupported("functions", json::array(), "") ||
      !r.Unsupported("parallel_tool_calls", false, "")) {
    return false;
  }
  if (const json* format = r.Get("response_format")) {
    const auto type = format->is_object() ? format->find("type") : format->end();
    if (type == format->end() || !type->is_string() ||
        (*type != "text" && *type != "json_object")) {
      return r.Fail("response_format",
                    "`response_format` must be {\"type\": \"text\"} or {\"type\": "
                    "\"json_object\"} (json_schema is not supported by this server)");
    }
    if (*type == "json_object") sampling.set_response_format(v1::RESPONSE_FORMAT_JSON_OBJECT);
  }
  if (prompt_logprobs) {
    out.prompt_logprobs = static_cast<int>(*prompt_logprobs);
    sampling.set_prompt_logprobs(out.prompt_logprobs);
  }
  if (temperature) sampling.set_temperature(static_cast<float>(*temperature));
  if (top_p) sampling.set_top_p(static_cast<float>(*top_p));
  if (min_p) sampling.set_min_p(static_cast<float>(*min_p));
  if (repetition) sampling.set_repetition_penalty(static_cast<float>(*repetition));
  if (presence) sampling.set_presence_penalty(static_cast<float>(*presence));
  if (frequency) sampling.set_frequency_penalty(static_cast<float>(*frequency));
  if (seed) sampling.set_seed(static_cast<uint64_t>(*seed));
  if (top_k && *top_k > 0) sampling.set_top_k(static_cast<int32_t>(*top_k));
  if (min_tokens) stopping.set_min_tokens(static_cast<int32_t>(*min_tokens));
  if (ignore_eos) stopping.set_ignore_eos(*ignore_eos);
  if (include_stop) stopping.set_include_stop_str_in_output(*include_stop);
  // vLLM's default: the text leaves special tokens out.
  req.set_skip_special_tokens(skip_special.value_or(true));
  if (const json* bias = r.Get("logit_bias")) {
    if (!bias->is_object()) return r.Fail("logit_bias", "`logit_bias` maps token ids to numbers");
    for (const auto& [key, value] : bias->items()) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(key, &id) || !value.is_number()) {
        return r.Fail("logit_bias", "`logit_bias` maps token ids (as strings) to numbers");
      }
      (*sampling.mutable_logit_bias())[id] = value.get<float>();
    }
  }
  if (const json* ids = r.Get("stop_token_ids")) {
    v1::TokenIds parsed;
    if (!ids->is_array() || !ParseTokenIds(*ids, parsed)) {
      return r.Fail("stop_token_ids", "`stop_token_ids` must be a list of token ids");
    }
    for (int32_t id : parsed.ids()) stopping.add_stop_token_ids(id);
  }
  if (!ParseStop(r, stopping)) return false;
  std::optional<bool> stream;
  if (!r.Bool("stream", stream)) return false;
  out.stream = stream.value_or(false);
  if (const json* options = r.Get("stream_options")) {
    if (!out.stream) return r.Fail("stream_options", "`stream_options` needs `stream: true`");
    if (!options->is_object()) return r.Fail("stream_options", "`stream_options` is an object");
    auto usage = options->find("include_usage");
    if (usage != options->end() && !usage->is_boolean()) {
      return r.Fail("stream_options.include_usage", "`include_usage` must be true or false");
    }
    out.include_usage = usage != options->end() && usage->get<bool>();
  }
  if (const json* model = r.Get("model")) {
    if (!model->is_string()) return r.Fail("model", "`model` must be a string");
    out.model = model->get<std::string>();
  }
  if (const json* user = r.Get("user")) {
    if (!user->is_string()) return r.Fail("user", "`user` must be a string");
    out.request.set_user(user->get<std::string>());  // the router's log line names it
  }
  // Not OpenAI's: the gRPC API's conversation (its next turn takes the stored KV over).
  if (const json* session = r.Get("session_id")) {
    if (!session->is_string()) return r.Fail("session_id", "`session_id` must be a string");
    out.request.set_session_id(session->get<std::string>());
  }
  return true;
}

}  // namespace

bool ParseRequest(Endpoint endpoint, absl::string_view body, ParsedRequest& out, ApiError& error) {
  json parsed;
  if (!ParseObject(body, parsed, error)) return false;
  Reader r{parsed, error};
  v1::GenerateRequest& req = out.request;
  std::optional<int64_t> max_tokens, max_completion_tokens;
  // Completions' `max_tokens: 0` (with `echo`) scores the prompt only.
  const int64_t least_max_tokens = endpoint == Endpoint::kCompletions ? 0 : 1;
  if (!r.Integer("max_tokens", least_max_tokens, std::numeric_limits<int32_t>::max(), max_tokens) ||
      !r.Integer("max_completion_tokens", 1, std::numeric_limits<int32_t>::max(),
                 max_completion_tokens)) {
    return false;
  }
  if (endpoint == Endpoint::kCompletions) {
    if (!ParsePrompt(r, out)) return false;
    std::optional<int64_t> logprobs;
    std::optional<bool> echo;
    if (!r.Integer("logprobs", 0, kMaxLogprobs, logprobs) || !r.Bool("echo", echo)) return false;
    out.top_logprobs = logprobs.has_value() ? static_cast<int>(*logprobs) : -1;
    out.echo = echo.value_or(false);
    out.prompt_only = max_tokens == 0;
    if (out.prompt_only && !out.echo) {
      return r.Fail("max_tokens",
                    "`max_tokens: 0` returns the prompt only: it needs `echo: true` (or ask for "
                    "at least 1 token)");
    }
    // OpenAI's default for completions is 16 tokens; 0 (the prompt alone) is the gRPC API's
    // prompt-only request: one prefill, its prompt logprobs, no token.
    req.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(max_tokens.value_or(16)));
  } else {
    if (!r.Unsupported("echo", false, " on chat completions")) return false;
    if (!ParseMessages(r, req)) return false;
    if (max_completion_tokens || max_tokens) {
      req.mutable_stopping()->set_max_new_tokens(
          static_cast<int32_t>(max_completion_tokens.value_or(max_tokens.value_or(0))));
    }
    std::optional<bool> logprobs;
    std::optional<int64_t> top;
    if (!r.Bool("logprobs", logprobs) || !r.Integer("top_logprobs", 0, kMaxLogprobs, top)) {
      return false;
    }
    if (top.has_value() && !logprobs.value_or(false)) {
      return r.Fail("top_logprobs", "`top_logprobs` needs `logprobs: true`");
    }
    out.top_logprobs = logprobs.value_or(false) ? static_cast<int>(top.value_or(0)) : -1;
  }
  if (!ParseSampling(r, out)) return false;
  if (out.prompt_only && req.stopping().min_tokens() > 0) {
    return r.Fail("min_tokens", "`min_tokens` must not exceed `max_tokens` (0: the prompt only)");
  }
  if (out.prompt_only && out.n > 1) {
    return r.Fail("n", "`max_tokens: 0` returns the prompt once: it needs `n` 1");
  }
  if (out.prompts() * out.n > kMaxChoices) {
    return r.Fail("n", absl::StrCat("a request asks for at most ", kMaxChoices,
                                    " choices (prompts x n), not ", out.prompts() * out.n));
  }
  if (out.top_logprobs >= 0) req.mutable_sampling()->set_logprobs(out.top_logprobs);
  if (out.echo && out.top_logprobs >= 0) {
    // The prompt's entries are its prompt logprobs, which come with the first sample only.
    if (out.n > 1) return r.Fail("echo", "`echo` with `logprobs` needs `n` 1");
    if (out.prompt_logprobs >= 0 && out.prompt_logprobs != out.top_logprobs) {
      return r.Fail("prompt_logprobs",
                    "with `echo` and `logprobs`, `prompt_logprobs` must equal `logprobs`");
    }
    req.mutable_sampling()->set_prompt_logprobs(out.top_logprobs);
  }
  return true;
}

v1::GenerateRequest ParsedRequest::Request(int prompt) const {
  if (batch.empty()) return request;
  v1::GenerateRequest out = request;
  const v1::GenerateRequest& input = batch.at(static_cast<size_t>(prompt));
  if (input.has_token_ids()) {
    *out.mutable_token_ids() = input.token_ids();
  } else {
    out.set_text(input.text());
  }
  return out;
}

bool ParseTokenizeRequest(absl::string_view body, bool detokenize, TokenizeCall& out,
                          ApiError& error) {
  json parsed;
  if (!ParseObject(body, parsed, error)) return false;
  Reader r{parsed, error};
  if (const json* model = r.Get("model")) {
    if (!model->is_string()) return r.Fail("model", "`model` must be a string");
    out.model = model->get<std::string>();
  }
  if (detokenize) {
    const json* tokens = r.Get("tokens");
    if (tokens == nullptr || !tokens->is_array() ||
        !ParseTokenIds(*tokens, *out.request.mutable_token_ids())) {
      return r.Fail("tokens", "`tokens` must be a list of token ids");
    }
    return true;
  }
  std::optional<bool> add_special, add_generation_prompt, token_strs;
  if (!r.Bool("add_special_tokens", add_special) ||
      !r.Bool("add_generation_prompt", add_generation_prompt) ||
      !r.Bool("return_token_strs", token_strs)) {
    return false;
  }
  out.token_strs = token_strs.value_or(false);
  if (!r.Unsupported("continue_final_message", false, "") ||
      !r.Unsupported("chat_template", "", " (the model's own is used)") ||
      !r.Unsupported("chat_template_kwargs", json::object(), "") ||
      !r.Unsupported("tools", json::array(), "")) {
    return false;
  }
  const bool has_prompt = r.Get("prompt") != nullptr, has_messages = r.Get("messages") != nullptr;
  if (has_prompt == has_messages) {
    return r.Fail(has_prompt ? "messages" : "prompt",
                  "give exactly one of `prompt` (a string) and `messages`");
  }
  if (has_prompt) {
    const json& prompt = *r.Get("prompt");
    if (!prompt.is_string()) return r.Fail("prompt", "`prompt` must be a string");
    out.request.set_text(prompt.get<std::string>());
    out.request.set_add_special(add_special.value_or(true));
    return true;
  }
  if (!add_generation_prompt.value_or(true)) {
    return r.Fail("add_generation_prompt",
                  "messages are rendered as a chat completion renders them: with the generation "
                  "prompt");
  }
  if (!r.Unsupported("add_special_tokens", false, " with `messages` (the template adds them)")) {
    return false;
  }
  v1::GenerateRequest holder;
  if (!ParseMessages(r, holder)) return false;
  *out.request.mutable_messages() = std::move(*holder.mutable_messages());
  return true;
}

}  // namespace infinigen::openai
