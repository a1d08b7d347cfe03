#include "router/request_validation.h"

#include "absl/strings/str_cat.h"

namespace infinigen {

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
      if (r.token_ids().ids_size() > limits.max_prompt_tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("token_ids: the prompt has ", r.token_ids().ids_size(),
                         " tokens; the limit (max_prompt_tokens) is ", limits.max_prompt_tokens));
      }
      break;
    case v1::GenerateRequest::kMessages:
      if (r.messages().messages().empty()) {
        return absl::InvalidArgumentError("messages: the list is empty");
      }
      for (int i = 0; i < r.messages().messages_size(); ++i) {
        const std::string& role = r.messages().messages(i).role();
        if (role != "system" && role != "user" && role != "assistant") {
          return absl::InvalidArgumentError(
              absl::StrCat("messages[", i, "].role is '", role,
                           "'; the accepted roles are system, user and assistant"));
        }
      }
      break;
    default:
      return absl::InvalidArgumentError("input: give one of text, token_ids or messages");
  }
  if (r.stopping().has_max_new_tokens() &&
      (r.stopping().max_new_tokens() < 1 ||
       r.stopping().max_new_tokens() > limits.max_new_tokens_limit)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stopping.max_new_tokens is ", r.stopping().max_new_tokens(), "; it must be in [1, ",
        limits.max_new_tokens_limit, "] (max_new_tokens_limit)"));
  }
  if (r.sampling().n() < 0 || r.sampling().n() > kMaxSamples) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.n is ", r.sampling().n(), "; it must be in [1, ", kMaxSamples, "] (0: 1)"));
  }
  if (r.request_id().size() > kMaxRequestIdBytes || r.session_id().size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id and session_id may have at most ", kMaxRequestIdBytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace infinigen
