// libFuzzer target for the OpenAI-compatible API's JSON (openai/request_json.h, response_json.h):
// the input's first byte picks the endpoint, the rest is an HTTP body (also tried as a /tokenize
// body). A body is either refused with a 400 whose error renders as JSON, or becomes a
// GenerateRequest with an input that serializes; and the response objects built around it, with
// texts and token texts cut from the input (any bytes, invalid UTF-8 included), are always valid
// JSON. scripts/fuzz.sh builds it with clang and runs it for a bounded time.
#include <algorithm>
#include <cstdint>
#include <string>

#include "nlohmann/json.hpp"
#include "openai/request_json.h"
#include "openai/response_json.h"

namespace {

using infinigen::openai::Endpoint;

bool IsJson(const std::string& s) {
  return !nlohmann::json::parse(s, nullptr, false).is_discarded();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Endpoint endpoint =
      (data[0] & 1) != 0 ? Endpoint::kChatCompletions : Endpoint::kCompletions;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  // The same body as vLLM's /tokenize or /detokenize (bit 1): refused with a 400, or a request
  // with an input; answers with pieces of the input's bytes are valid JSON.
  {
    infinigen::openai::TokenizeCall call;
    infinigen::openai::ApiError error;
    if (!infinigen::openai::ParseTokenizeRequest(body, (data[0] & 2) != 0, call, error)) {
      if (error.http_status != 400 || error.message.empty()) __builtin_trap();
    } else if (call.request.input_case() == infinigen::v1::TokenizeRequest::INPUT_NOT_SET) {
      __builtin_trap();
    }
    infinigen::v1::TokenizeResponse answer;
    answer.add_pieces(body.substr(0, 5));
    answer.set_text(body.substr(0, 9));
    if (!IsJson(infinigen::openai::TokenizeJson(answer, 8, true)) ||
        !IsJson(infinigen::openai::DetokenizeJson(answer))) {
      __builtin_trap();
    }
  }
  infinigen::openai::ParsedRequest parsed;
  infinigen::openai::ApiError error;
  if (!infinigen::openai::ParseRequest(endpoint, body, parsed, error)) {
    if (error.http_status != 400 || error.message.empty()) __builtin_trap();
    if (!IsJson(infinigen::openai::ErrorJson(error))) __builtin_trap();
    return 0;
  }
  if (parsed.top_logprobs > 20) __builtin_trap();
  // Every prompt of a batch is a request with an input that serializes.
  if (parsed.prompts() < 1 || parsed.prompts() > infinigen::openai::kMaxPrompts ||
      parsed.prompts() * parsed.n > infinigen::openai::kMaxChoices) {
    __builtin_trap();
  }
  for (int p = 0; p < parsed.prompts(); ++p) {
    const infinigen::v1::GenerateRequest r = parsed.Request(p);
    if (r.input_case() == infinigen::v1::GenerateRequest::INPUT_NOT_SET) __builtin_trap();
    std::string bytes;
    if (!r.SerializeToString(&bytes)) __builtin_trap();  // strings from JSON are valid UTF-8
  }

  // Responses whose texts are raw bytes of the input.
  auto cut = [&](size_t at, size_t n) { return body.substr(std::min(at, body.size()), n); };
  infinigen::openai::ResponseBuilder builder(
      endpoint, "id", 0, cut(0, 8), std::max(parsed.top_logprobs, 1),
      [&](int32_t id) { return cut(static_cast<size_t>(id) % (body.size() + 1), 3); });
  infinigen::v1::GenerateResponse m;
  m.set_text(cut(1, 7));
  for (int i = 0; i < 3; ++i) {
    m.add_token_ids(i * 5);
    infinigen::v1::Logprobs* lp = m.add_logprobs();
    lp->set_logprob(-1.0f * i);
    lp->add_top()->set_token_id(i * 7 + 1);
  }
  m.set_finish_reason(static_cast<infinigen::v1::FinishReason>(size % 4));
  m.mutable_usage()->set_prompt_tokens(static_cast<int32_t>(size));
  for (const std::string& chunk : builder.Chunks(m)) {
    if (!IsJson(chunk)) __builtin_trap();
  }
  builder.Add(m);
  if (!IsJson(builder.Whole()) || !IsJson(builder.UsageChunk())) __builtin_trap();
  return 0;
}
