#include "frontend/request_validation.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "frontend/stop_strings.h"

namespace infinigen {

absl::Status RequestLimits::Validate() const {
  if (max_request_bytes < 1024) {
    return absl::InvalidArgumentError("max_request_bytes must be >= 1024");
  }
  if (max_prompt_tokens < 0) {
    return absl::InvalidArgumentError("max_prompt_tokens must be >= 0 (0: the model's context)");
  }
  if (max_new_tokens_limit < 1) {
    return absl::InvalidArgumentError("max_new_tokens_limit must be >= 1");
  }
  if (default_max_new_tokens < 0 || default_max_new_tokens > max_new_tokens_limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_max_new_tokens is ", default_max_new_tokens,
                     "; it must be in [0, max_new_tokens_limit = ", max_new_tokens_limit,
                     "] (0: the smaller of 256 and max_new_tokens_limit)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerateOptions> RequestOptions(const v1::SamplingParams& s,
                                               const v1::StoppingCriteria& stop,
                                               const RequestLimits& limits) {
  if (s.n() < 0 || s.n() > kMaxSamples) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.n is ", s.n(), "; it must be in [1, ", kMaxSamples, "] (0: 1)"));
  }
  GenerateOptions o;
  o.sampling.temperature = s.has_temperature() ? s.temperature() : 1.0f;
  o.sampling.top_k = s.top_k();
  o.sampling.top_p = s.has_top_p() ? s.top_p() : 1.0f;
  o.sampling.min_p = s.min_p();
  o.sampling.repetition_penalty = s.has_repetition_penalty() ? s.repetition_penalty() : 1.0f;
  o.sampling.presence_penalty = s.presence_penalty();
  o.sampling.frequency_penalty = s.frequency_penalty();
  switch (s.response_format()) {
    case v1::RESPONSE_FORMAT_TEXT:
      break;
    case v1::RESPONSE_FORMAT_JSON_OBJECT:
      o.json_object = true;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.response_format: ", static_cast<int>(s.response_format()),
                       " is not a response format (TEXT 0, "
                       "JSON_OBJECT 1)"));
  }
  o.sampling.seed = s.seed();
  o.logprobs = s.has_logprobs() ? s.logprobs() : -1;
  o.prompt_logprobs = s.has_prompt_logprobs() ? s.prompt_logprobs() : -1;
  o.max_new_tokens =
      stop.has_max_new_tokens() ? stop.max_new_tokens() : limits.DefaultMaxNewTokens();
  // 0: the prompt alone (its KV computed and stored, its logprobs with prompt_logprobs).
  if (o.max_new_tokens < 0 || o.max_new_tokens > limits.max_new_tokens_limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("stopping.max_new_tokens is ", o.max_new_tokens, "; it must be in [0, ",
                     limits.max_new_tokens_limit, "] (max_new_tokens_limit; 0: the prompt only)"));
  }
  if (o.max_new_tokens == 0 && s.n() > 1) {
    return absl::InvalidArgumentError(
        "sampling.n > 1 with stopping.max_new_tokens 0: a prompt-only request has no samples");
  }
  o.stop_token_ids.assign(stop.stop_token_ids().begin(), stop.stop_token_ids().end());
  for (int32_t id : o.stop_token_ids) {
    if (id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("stopping.stop_token_ids: ", id, " is not a token id"));
    }
  }
  o.ignore_eos = stop.ignore_eos();
  o.min_tokens = stop.min_tokens();
  if (s.logit_bias_size() > kMaxLogitBias) {  // before copying a map of any size
    return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias has ", s.logit_bias_size(),
                                                   " entries; at most ", kMaxLogitBias));
  }
  for (const auto& [id, bias] : s.logit_bias()) {
    if (id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.logit_bias: ", id, " is not a token id"));
    }
    o.logit_bias.emplace_back(id, bias);
  }
  std::sort(o.logit_bias.begin(), o.logit_bias.end());  // map order is unspecified
  IG_RETURN_IF_ERROR(ValidateStopStrings(
      std::vector<std::string>(stop.stop_strings().begin(), stop.stop_strings().end()),
      "stopping.stop_strings"));
  IG_RETURN_IF_ERROR(o.Validate());
  return o;
}

absl::Status ValidateChatMessages(const v1::ChatMessages& messages) {
  if (messages.messages().empty()) return absl::InvalidArgumentError("messages: the list is empty");
  for (int i = 0; i < messages.messages_size(); ++i) {
    const std::string& role = messages.messages(i).role();
    if (role != "system" && role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "].role is '", role,
                       "'; the accepted roles are system, user and assistant"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateGenerateRequest(const v1::GenerateRequest& r, const RequestLimits& limits) {
  const size_t bytes = r.ByteSizeLong();
  if (static_cast<int64_t>(bytes) > limits.max_request_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("the request has ", bytes,
                                                   " bytes; the limit "
                                                   "(max_request_bytes) is ",
                                                   limits.max_request_bytes));
  }
  switch (r.input_case()) {
    case v1::GenerateRequest::kText:
      if (r.text().empty()) return absl::InvalidArgumentError("text: the prompt is empty");
      break;
    case v1::GenerateRequest::kTokenIds:
      if (r.token_ids().ids().empty()) {
        return absl::InvalidArgumentError("token_ids: the prompt is empty");
      }
      if (limits.max_prompt_tokens > 0 && r.token_ids().ids_size() > limits.max_prompt_tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("token_ids: the prompt has ", r.token_ids().ids_size(),
                         " tokens; the limit (max_prompt_tokens) is ", limits.max_prompt_tokens));
      }
      break;
    case v1::GenerateRequest::kMessages:
      IG_RETURN_IF_ERROR(ValidateChatMessages(r.messages()));
      break;
    default:
      return absl::InvalidArgumentError("input: give one of text, token_ids or messages");
  }
  IG_RETURN_IF_ERROR(RequestOptions(r.sampling(), r.stopping(), limits).status());
  if (r.sampling().n() > 1 && !r.session_id().empty()) {
    return absl::InvalidArgumentError(
        "sampling.n > 1 cannot be combined with a session_id (a conversation has one answer)");
  }
  if (r.request_id().size() > kMaxRequestIdBytes || r.session_id().size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id and session_id may have at most ", kMaxRequestIdBytes, " bytes"));
  }
  if (r.user().size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("user may have at most ", kMaxRequestIdBytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace infinigen
