#include "frontend/prompt.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {

absl::StatusOr<std::string> RenderChat(const Tokenizer& tokenizer,
                                       const std::vector<ChatMessage>& messages,
                                       absl::string_view chat_format) {
  if (messages.empty()) return absl::InvalidArgumentError("messages: the list is empty");
  const std::string bos = tokenizer.TokenText(tokenizer.bos_id());
  const std::string eos =
      tokenizer.eos_ids().empty() ? "" : tokenizer.TokenText(tokenizer.eos_ids()[0]);
  IG_ASSIGN_OR_RETURN(ChatTemplate tmpl,
                      chat_format.empty()
                          ? ChatTemplate::FromJinja(tokenizer.chat_template(), bos, eos)
                          : ChatTemplate::ForFormat(chat_format, bos, eos));
  return tmpl.Render(messages, /*add_generation_prompt=*/true);
}

absl::StatusOr<std::vector<int32_t>> EncodeTextPrompt(const Tokenizer& tokenizer,
                                                      absl::string_view text) {
  if (text.empty()) return absl::InvalidArgumentError("text: the prompt is empty");
  return tokenizer.Encode(text, /*add_special=*/true);
}

absl::StatusOr<std::vector<int32_t>> EncodeChatPrompt(const Tokenizer& tokenizer,
                                                      const std::vector<ChatMessage>& messages,
                                                      absl::string_view chat_format) {
  IG_ASSIGN_OR_RETURN(std::string text, RenderChat(tokenizer, messages, chat_format));
  return tokenizer.Encode(text, /*add_special=*/false);
}

absl::Status CheckPromptLength(int64_t tokens, int64_t server_limit, int64_t context_tokens,
                               int64_t caller_limit) {
  int64_t limit = server_limit > 0 ? std::min(server_limit, context_tokens) : context_tokens;
  if (caller_limit > 0) limit = std::min(limit, caller_limit);
  if (tokens > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt has ", tokens, " tokens; the limit (max_prompt_tokens) is ", limit));
  }
  return absl::OkStatus();
}

}  // namespace infinigen
