#include "openai/response_json.h"

#include <algorithm>

namespace infinigen::openai {

using nlohmann::json;

std::string TokenizeJson(const v1::TokenizeResponse& response, int64_t max_model_len,
                         bool token_strs) {
  json body = {{"count", response.token_ids_size()},
               {"max_model_len", max_model_len},
               {"tokens", json(std::vector<int32_t>(response.token_ids().begin(),
                                                    response.token_ids().end()))},
               {"token_strs", nullptr}};
  if (token_strs) {
    body["token_strs"] =
        json(std::vector<std::string>(response.pieces().begin(), response.pieces().end()));
  }
  // A piece of a multi-byte character may be invalid UTF-8: U+FFFD, never an exception.
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string DetokenizeJson(const v1::TokenizeResponse& response) {
  return json{{"prompt", response.text()}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

ResponseBuilder::ResponseBuilder(Endpoint endpoint, std::string id, int64_t created,
                                 std::string model, int top_logprobs, TokenText token_text, int n,
                                 int prompts)
    : endpoint_(endpoint),
      id_(std::move(id)),
      created_(created),
      model_(std::move(model)),
      top_logprobs_(top_logprobs),
      token_text_(std::move(token_text)),
      n_(std::max(n, 1)),
      choices_(static_cast<size_t>(n_) * static_cast<size_t>(std::max(prompts, 1))),
      echoes_(static_cast<size_t>(std::max(prompts, 1))) {
  for (size_t i = 0; i < choices_.size(); ++i) {
    choices_[i].prompt = static_cast<int>(i / static_cast<size_t>(n_));
    choices_[i].logprobs = EmptyLogprobs();
  }
}

json ResponseBuilder::EmptyLogprobs() const {
  return endpoint_ == Endpoint::kCompletions ? json{{"tokens", json::array()},
                                                    {"token_logprobs", json::array()},
                                                    {"top_logprobs", json::array()},
                                                    {"text_offset", json::array()}}
                                             : json{{"content", json::array()}};
}

const char* ResponseBuilder::FinishReason(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_CANCELLED:
      return "abort";  // vLLM's name
    default:
      return nullptr;
  }
}

const char* ResponseBuilder::Finish(const v1::GenerateResponse& response) const {
  const char* finish = FinishReason(response.finish_reason());
  // The prompt alone ends at its length whatever its one (left out) sample was.
  return prompt_only_ && finish != nullptr &&
                 response.finish_reason() != v1::FINISH_REASON_CANCELLED
             ? "length"
             : finish;
}

std::string ResponseBuilder::Generated(const v1::GenerateResponse& response) const {
  return prompt_only_ ? std::string() : response.text();
}

namespace {

// vLLM's `stop_reason` of a choice: the stop token id or stop string that ended it, null when
// it ended otherwise (vLLM gives null for the end-of-sequence token too; here its id).
json StopReasonJson(const v1::GenerateResponse& response) {
  if (response.finish_reason() != v1::FINISH_REASON_STOP) return json();
  switch (response.stop().kind_case()) {
    case v1::StopReason::kTokenId:
      return response.stop().token_id();
    case v1::StopReason::kStopString:
      return response.stop().stop_string();
    default:
      return json();
  }
}

}  // namespace

json ResponseBuilder::Object(const char* object) const {
  return json{{"id", id_}, {"object", object}, {"created", created_}, {"model", model_}};
}

json ResponseBuilder::UsageJson() const {
  int64_t prompt = 0, cached = 0;
  for (size_t i = 0; i < choices_.size(); i += static_cast<size_t>(n_)) {
    prompt += choices_[i].usage.prompt_tokens();
    cached += choices_[i].usage.cached_tokens();
  }
  int64_t completion = 0;
  if (!prompt_only_) {
    for (const Choice& c : choices_) completion += c.usage.generated_tokens();
  }
  return json{{"prompt_tokens", prompt},
              {"completion_tokens", completion},
              {"total_tokens", prompt + completion},
              {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

namespace {

json Bytes(const std::string& s) {
  json out = json::array();
  for (unsigned char c : s) out.push_back(static_cast<int>(c));
  return out;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

void ResponseBuilder::AddLogprobs(Choice& choice, const v1::GenerateResponse& response,
                                  json& into) {
  const int n = prompt_only_ ? 0 : std::min(response.token_ids_size(), response.logprobs_size());
  for (int i = 0; i < n; ++i) {
    const v1::Logprobs& lp = response.logprobs(i);
    const std::string token = Text(lp, response.token_ids(i));
    if (endpoint_ == Endpoint::kCompletions) {
      json top = json::object();
      // Two alternatives can decode to the same text: the more likely (first) one keeps it.
      for (const v1::TokenLogprob& t : lp.top()) top.emplace(Text(t, t.token_id()), t.logprob());
      into["tokens"].push_back(token);
      into["token_logprobs"].push_back(lp.logprob());
      into["top_logprobs"].push_back(std::move(top));
      into["text_offset"].push_back(choice.text_offset);
      choice.text_offset += static_cast<int64_t>(token.size());
    } else {
      json top = json::array();
      for (const v1::TokenLogprob& t : lp.top()) {
        const std::string alt = Text(t, t.token_id());
        top.push_back({{"token", alt}, {"logprob", t.logprob()}, {"bytes", Bytes(alt)}});
      }
      into["content"].push_back({{"token", token},
                                 {"logprob", lp.logprob()},
                                 {"bytes", Bytes(token)},
                                 {"top_logprobs", std::move(top)}});
    }
  }
}

void ResponseBuilder::Echo(std::string prompt_text, std::vector<std::string> prompt_pieces,
                           bool show_prompt_logprobs, bool prompt_only, int prompt) {
  echo_ = true;
  prompt_only_ = prompt_only;
  Echoed& e = echoes_.at(static_cast<size_t>(prompt));
  e.text = std::move(prompt_text);
  e.pieces = std::move(prompt_pieces);
  show_prompt_logprobs_ = show_prompt_logprobs;
}

std::string ResponseBuilder::EchoPrompt(Choice& choice, const v1::GenerateResponse& response,
                                        json* logprobs) {
  if (!echo_ || choice.echoed) return Generated(response);
  choice.echoed = true;
  const Echoed& e = echoes_[static_cast<size_t>(choice.prompt)];
  if (logprobs != nullptr) {
    json& into = *logprobs;
    // The prompt tokens' texts are their pieces (each as it adds to the decoded prompt, so that
    // they join to it); their offsets end where the prompt's text ends (a BOS the model adds,
    // whose text the prompt has not, starts before it: clamped to 0).
    const bool pieces = e.pieces.size() == static_cast<size_t>(response.prompt_logprobs_size()) + 1;
    int64_t joined = 0;
    for (const std::string& p : e.pieces) joined += static_cast<int64_t>(p.size());
    int64_t offset = pieces ? static_cast<int64_t>(e.text.size()) - joined : 0;
    auto add = [&](const std::string& token, json logprob, json top) {
      into["tokens"].push_back(token);
      into["token_logprobs"].push_back(std::move(logprob));
      into["top_logprobs"].push_back(std::move(top));
      into["text_offset"].push_back(std::max<int64_t>(offset, 0));
      offset += static_cast<int64_t>(token.size());
    };
    add(e.pieces.empty() ? std::string() : e.pieces[0], nullptr, nullptr);
    for (int j = 0; j < response.prompt_logprobs_size(); ++j) {
      const v1::Logprobs& lp = response.prompt_logprobs(j);
      json top = json::object();
      // Two alternatives can decode to the same text: the more likely (first) one keeps it.
      for (const v1::TokenLogprob& t : lp.top()) top.emplace(Text(t, t.token_id()), t.logprob());
      add(pieces ? e.pieces[j + 1] : Text(lp, lp.token_id()), lp.logprob(), std::move(top));
    }
    choice.text_offset = static_cast<int64_t>(e.text.size());
  }
  return e.text + Generated(response);
}

json ResponseBuilder::PromptLogprobs(const v1::GenerateResponse& response) {
  json out = json::array({nullptr});  // the first prompt token has no context
  for (const v1::Logprobs& lp : response.prompt_logprobs()) {
    json at = json::object();
    at[std::to_string(lp.token_id())] = {
        {"logprob", lp.logprob()}, {"rank", lp.rank()}, {"decoded_token", Text(lp, lp.token_id())}};
    for (int i = 0; i < lp.top_size(); ++i) {
      const v1::TokenLogprob& t = lp.top(i);
      const std::string key = std::to_string(t.token_id());
      if (at.contains(key)) continue;
      at[key] = {
          {"logprob", t.logprob()}, {"rank", i + 1}, {"decoded_token", Text(t, t.token_id())}};
    }
    out.push_back(std::move(at));
  }
  return out;
}

std::vector<std::string> ResponseBuilder::Chunks(int index, const v1::GenerateResponse& response) {
  std::vector<std::string> out;
  Choice& c = choices_.at(static_cast<size_t>(index));
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  if (response.has_usage()) c.usage = response.usage();
  const char* finish = Finish(response);
  if (chat && !c.role_sent) {
    c.role_sent = true;
    json chunk = Object("chat.completion.chunk");
    chunk["choices"] = json::array({{{"index", index},
                                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                                     {"logprobs", nullptr},
                                     {"finish_reason", nullptr}}});
    out.push_back(Dump(chunk));
  }
  const bool echoing = echo_ && !c.echoed;  // this message's entries start with the prompt's
  if (response.text().empty() && response.token_ids_size() == 0 &&
      response.prompt_logprobs_size() == 0 && finish == nullptr) {
    return out;
  }
  if (prompt_only_ && !echoing && finish == nullptr) return out;  // nothing of it is sent
  json choice = {{"index", index}, {"finish_reason", finish ? json(finish) : json()}};
  if (finish != nullptr) {
    choice["stop_reason"] = prompt_only_ ? json() : StopReasonJson(response);
    choice["seed"] = static_cast<int64_t>(response.seed());  // not OpenAI's: see Choice::seed
  }
  json lp = top_logprobs_ >= 0 ? EmptyLogprobs() : json();
  if (chat) {
    choice["delta"] = response.text().empty() ? json::object() : json{{"content", response.text()}};
  } else {
    choice["text"] = EchoPrompt(c, response, lp.is_null() ? nullptr : &lp);
  }
  if (!lp.is_null() && ((!prompt_only_ && response.logprobs_size() > 0) || echoing)) {
    AddLogprobs(c, response, lp);
    choice["logprobs"] = std::move(lp);
  } else {
    choice["logprobs"] = nullptr;
  }
  json prompt = response.prompt_logprobs_size() > 0 && show_prompt_logprobs_
                    ? PromptLogprobs(response)
                    : json();
  if (!chat && !prompt.is_null()) choice["prompt_logprobs"] = prompt;  // vLLM: per choice
  json chunk = Object(chat ? "chat.completion.chunk" : "text_completion");
  chunk["choices"] = json::array({std::move(choice)});
  if (chat && !prompt.is_null()) chunk["prompt_logprobs"] = std::move(prompt);  // vLLM: top level
  out.push_back(Dump(chunk));
  return out;
}

std::string ResponseBuilder::UsageChunk() const {
  json chunk =
      Object(endpoint_ == Endpoint::kChatCompletions ? "chat.completion.chunk" : "text_completion");
  chunk["choices"] = json::array();
  chunk["usage"] = UsageJson();
  return Dump(chunk);
}

void ResponseBuilder::Add(int index, const v1::GenerateResponse& response) {
  Choice& c = choices_.at(static_cast<size_t>(index));
  c.text += EchoPrompt(c, response, top_logprobs_ >= 0 ? &c.logprobs : nullptr);
  if (response.prompt_logprobs_size() > 0 && show_prompt_logprobs_) {
    c.prompt_logprobs = PromptLogprobs(response);
  }
  if (top_logprobs_ >= 0) AddLogprobs(c, response, c.logprobs);
  if (const char* finish = Finish(response)) {
    c.finish_reason = finish;
    c.stop_reason = prompt_only_ ? json() : StopReasonJson(response);
    c.seed = static_cast<int64_t>(response.seed());
  }
  if (response.has_usage()) c.usage = response.usage();
}

std::string ResponseBuilder::Whole() const {
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    json choice = {{"index", i},
                   {"finish_reason", c.finish_reason.empty() ? json() : json(c.finish_reason)},
                   {"stop_reason", c.stop_reason},
                   {"seed", c.seed},
                   {"logprobs", top_logprobs_ >= 0 ? c.logprobs : json()}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    } else {
      choice["text"] = c.text;
      if (!c.prompt_logprobs.is_null()) choice["prompt_logprobs"] = c.prompt_logprobs;
    }
    choices.push_back(std::move(choice));
  }
  json whole = Object(chat ? "chat.completion" : "text_completion");
  whole["choices"] = std::move(choices);
  if (chat && !choices_[0].prompt_logprobs.is_null()) {
    whole["prompt_logprobs"] = choices_[0].prompt_logprobs;
  }
  whole["usage"] = UsageJson();
  return Dump(whole);
}

}  // namespace infinigen::openai
