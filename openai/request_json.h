// The OpenAI-compatible API's requests (docs/api.md, "OpenAI-compatible HTTP"): a completion or
// chat completion body translated into an infinigen.v1 GenerateRequest, and vLLM's /tokenize and
// /detokenize bodies into a TokenizeRequest. What the API has and we do not (tools, best_of,
// suffix) is refused by name, never ignored. No I/O: the HTTP front door
// (openai/http_front_door.h) does that; openai/response_json.h builds the answers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "frontend/request_validation.h"  // kMaxSamples (n), kMaxLogprobs
#include "infinigen/v1/generation.pb.h"
#include "openai/api_error.h"

namespace infinigen::openai {

enum class Endpoint { kCompletions, kChatCompletions };

struct ParsedRequest {
  v1::GenerateRequest request;
  std::string model;  // as the client named it (empty: the served one)
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  int n = 1;                   // choices per prompt (one call with sampling.n)
  // Log probabilities to return: completions' `logprobs` (alternatives per token) or chat's
  // `logprobs: true` with `top_logprobs`; -1: none.
  int top_logprobs = -1;
  // vLLM's `prompt_logprobs` (alternatives per prompt token); -1: none.
  int prompt_logprobs = -1;
  // Completions' `echo`: each choice's text starts with the prompt's, and with `logprobs` its
  // entries with the prompt tokens' (the request then asks for prompt logprobs).
  bool echo = false;
  // Completions' `max_tokens: 0` with `echo`: the prompt alone (its text, and with `logprobs`
  // its entries), no completion tokens (the gRPC request's max_new_tokens 0).
  bool prompt_only = false;
  // Completions' `prompt` as a list of several prompts (OpenAI's batch): each one's input alone
  // (its text or token ids), in order; `request` carries the first's input and every other field.
  // Each prompt is its own call of the gRPC API; its choices are prompt x n + i, OpenAI's order.
  // Empty for one prompt.
  std::vector<v1::GenerateRequest> batch;

  int prompts() const { return batch.empty() ? 1 : static_cast<int>(batch.size()); }
  // `request` with the input of prompt `prompt` (< prompts()).
  v1::GenerateRequest Request(int prompt) const;
};

// The most prompts one completions request may list, and the most choices (prompts x n) it may
// ask for: each prompt is a stream of the server's (openai/generate_calls.h).
inline constexpr int kMaxPrompts = 128;
inline constexpr int kMaxChoices = 256;

// Parses `body` as a request of `endpoint`. False with `error` (400, naming the field) when it is
// not one, or asks for something this server does not do.
bool ParseRequest(Endpoint endpoint, absl::string_view body, ParsedRequest& out, ApiError& error);

// vLLM's tokenizer endpoints. /tokenize: {"prompt": text, "add_special_tokens": true (the
// model's BOS, as a completion adds it)} or {"messages": [...], "add_generation_prompt": true}
// (rendered with the chat template, as a chat completion renders them; the prompt of
// add_generation_prompt false is not made); "return_token_strs" asks for each token's text.
// /detokenize: {"tokens": [ids]}. False with `error` (400, naming the field) otherwise.
struct TokenizeCall {
  v1::TokenizeRequest request;
  std::string model;  // as the client named it (empty: the served one)
  bool token_strs = false;
};
bool ParseTokenizeRequest(absl::string_view body, bool detokenize, TokenizeCall& out,
                          ApiError& error);

}  // namespace infinigen::openai
