// The OpenAI-compatible API's answers (docs/api.md, "OpenAI-compatible HTTP"): the
// GenerateResponses of a request's streams as OpenAI's objects, streamed (server-sent event
// chunks) or whole, and vLLM's /tokenize and /detokenize answers. No I/O: the HTTP front door
// (openai/http_front_door.h) does that; openai/request_json.h parses the requests.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "infinigen/v1/generation.pb.h"
#include "nlohmann/json.hpp"
#include "openai/request_json.h"  // Endpoint

namespace infinigen::openai {

// Their answers: {"count", "max_model_len", "tokens", "token_strs"} (token_strs: each token's
// text as it adds to the decoding, or null) and {"prompt"}.
std::string TokenizeJson(const v1::TokenizeResponse& response, int64_t max_model_len,
                         bool token_strs);
std::string DetokenizeJson(const v1::TokenizeResponse& response);

// A token's text for logprobs (the model's decoding of that one id), for the entries that come
// without it (a worker without a tokenizer; workers send it in Logprobs.token).
using TokenText = std::function<std::string(int32_t)>;

// Turns one request's GenerateResponses into OpenAI's objects: `n` choices of each of `prompts`
// prompts (choice prompt x n + i), each fed by its own stream of GenerateResponses. Not
// thread-safe; UsageChunk and Whole only after every choice's last message.
class ResponseBuilder {
 public:
  ResponseBuilder(Endpoint endpoint, std::string id, int64_t created, std::string model,
                  int top_logprobs, TokenText token_text, int n = 1, int prompts = 1);

  // Stream: the server-sent event payloads (JSON) for one GenerateResponse of choice `index`, in
  // order (chat's first chunk of a choice carries the assistant role). The last message's
  // finish reason ends the choice.
  std::vector<std::string> Chunks(int index, const v1::GenerateResponse& response);
  std::vector<std::string> Chunks(const v1::GenerateResponse& response) {
    return Chunks(0, response);
  }
  // Stream with include_usage: the last chunk (no choices, the usage of all of them).
  std::string UsageChunk() const;
  // Completions' echo, called for each prompt: the text of its choices starts with
  // `prompt_text`; with logprobs their entries start with the prompt's tokens, `prompt_pieces`
  // their texts as they join to the decoded prompt (Tokenize's pieces; the first has no logprob,
  // the others' are the first message's prompt_logprobs). vLLM's `prompt_logprobs` field is then
  // sent only when `show_prompt_logprobs`. `prompt_only` (ParsedRequest::prompt_only): the
  // generated text and entries are left out, the finish reason is "length" and usage counts no
  // completion tokens.
  void Echo(std::string prompt_text, std::vector<std::string> prompt_pieces,
            bool show_prompt_logprobs, bool prompt_only = false, int prompt = 0);
  // Whole: after every message was given to Add, the one response object.
  void Add(int index, const v1::GenerateResponse& response);
  void Add(const v1::GenerateResponse& response) { Add(0, response); }
  std::string Whole() const;

 private:
  struct Choice {
    int prompt = 0;  // the index of its prompt
    bool role_sent = false;
    nlohmann::json prompt_logprobs;  // whole: vLLM's list, null until the first message
    int64_t text_offset = 0;         // completions' logprobs.text_offset of the next token
    std::string text;                // whole: the text so far
    nlohmann::json logprobs;         // whole: the entries so far
    std::string finish_reason;       // empty: not finished
    nlohmann::json stop_reason;      // vLLM's: the stop token id or string that ended it, or null
    // The sampling seed the last message reported (the request's, or the one the router drew),
    // as the signed `seed` a request sends: sent back, it reproduces the answer.
    int64_t seed = 0;
    v1::Usage usage;
    bool echoed = false;  // the prompt's text (and entries) went before its first message's
  };
  // The choice's logprobs entries for the tokens of `response` (appended to `into`).
  void AddLogprobs(Choice& choice, const v1::GenerateResponse& response, nlohmann::json& into);
  // Echo: the prompt's text before the choice's first message's, and its tokens' logprobs
  // entries (appended to `logprobs`, null for none). The text to send with this message.
  std::string EchoPrompt(Choice& choice, const v1::GenerateResponse& response,
                         nlohmann::json* logprobs);
  nlohmann::json EmptyLogprobs() const;
  // vLLM's prompt_logprobs of the first message: [null, {"<id>": {logprob, rank,
  // decoded_token}, ...}, ...], the prompt token's entry first, then the alternatives'.
  nlohmann::json PromptLogprobs(const v1::GenerateResponse& response);
  nlohmann::json Object(const char* object) const;
  // The text of token `id` of a logprobs entry: the entry's own, else token_text_'s.
  template <class Entry>
  std::string Text(const Entry& entry, int32_t id) const {
    return entry.has_token() ? entry.token() : token_text_(id);
  }
  // Each prompt's tokens once (its n choices share it), generated tokens of all choices.
  nlohmann::json UsageJson() const;
  static const char* FinishReason(v1::FinishReason reason);
  // The finish reason to send for `response` (null: not finished), and its generated text.
  const char* Finish(const v1::GenerateResponse& response) const;
  std::string Generated(const v1::GenerateResponse& response) const;

  Endpoint endpoint_;
  std::string id_;
  int64_t created_;
  std::string model_;
  int top_logprobs_;
  TokenText token_text_;
  int n_;
  std::vector<Choice> choices_;
  bool echo_ = false;
  struct Echoed {
    std::string text;
    std::vector<std::string> pieces;
  };
  std::vector<Echoed> echoes_;  // by prompt
  bool show_prompt_logprobs_ = true;
  bool prompt_only_ = false;
};

}  // namespace infinigen::openai
