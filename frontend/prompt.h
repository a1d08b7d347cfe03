// A prompt's token ids from what a client sends: text (encoded with the model's special tokens,
// e.g. BOS) or a conversation rendered with the model's chat template (whose text holds the
// special tokens itself). The worker's API and the CLI build prompts with these.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpu_worker/tokenizer/chat_template.h"
#include "gpu_worker/tokenizer/tokenizer.h"

namespace infinigen {

// The conversation as the prompt text of `tokenizer`'s model, ending where the assistant's turn
// begins: its own chat template, or the named format (llama3, llama2, chatml) for a model
// without one. INVALID_ARGUMENT for an empty conversation.
absl::StatusOr<std::string> RenderChat(const Tokenizer& tokenizer,
                                       const std::vector<ChatMessage>& messages,
                                       absl::string_view chat_format = "");

// Text with the special tokens the tokenizer adds (BOS). INVALID_ARGUMENT when empty.
absl::StatusOr<std::vector<int32_t>> EncodeTextPrompt(const Tokenizer& tokenizer,
                                                      absl::string_view text);
// RenderChat, encoded as it is (the template placed BOS where the model wants it).
absl::StatusOr<std::vector<int32_t>> EncodeChatPrompt(const Tokenizer& tokenizer,
                                                      const std::vector<ChatMessage>& messages,
                                                      absl::string_view chat_format = "");

// The most prompt tokens a server accepts: its limit (0: none), the model's context and a
// caller's own cap (0: none), whichever is least; INVALID_ARGUMENT naming max_prompt_tokens when
// `tokens` exceeds it.
absl::Status CheckPromptLength(int64_t tokens, int64_t server_limit, int64_t context_tokens,
                               int64_t caller_limit = 0);

}  // namespace infinigen
