// Chat templates: render a conversation into the prompt text a chat model was trained on. The
// Jinja templates in tokenizer_config.json / GGUF files are recognized by family and rendered
// by hand-written code that reproduces their output exactly (tests compare with jinja2).
#pragma once

#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

enum class ChatFormat {
  kLlama3,  // <|start_header_id|>role<|end_header_id|>\n\n content <|eot_id|>
  kLlama2,  // <s>[INST] <<SYS>>\n system \n<</SYS>>\n\n user [/INST] assistant </s>
  kChatMl,  // <|im_start|>role\n content <|im_end|>\n (SmolLM2, Qwen, ...)
};

class ChatTemplate {
 public:
  // Recognizes the family of a Jinja chat template. `bos` and `eos` are the token texts the
  // template refers to as bos_token / eos_token. UNIMPLEMENTED names a template it cannot
  // reproduce; NOT_FOUND when the model has no template.
  static absl::StatusOr<ChatTemplate> FromJinja(absl::string_view jinja, std::string bos,
                                                std::string eos);
  // A family by name ("llama3", "llama2", "chatml"), for models without a template.
  static absl::StatusOr<ChatTemplate> ForFormat(absl::string_view name, std::string bos,
                                                std::string eos);

  ChatFormat format() const { return format_; }
  // INVALID_ARGUMENT when the conversation breaks the template's rules (e.g. Llama 2 roles
  // that do not alternate user/assistant).
  absl::StatusOr<std::string> Render(std::span<const ChatMessage> messages,
                                     bool add_generation_prompt) const;

 private:
  ChatTemplate(ChatFormat format, std::string bos, std::string eos)
      : format_(format), bos_(std::move(bos)), eos_(std::move(eos)) {}

  ChatFormat format_;
  std::string bos_, eos_;
  std::string default_system_;  // ChatML templates that insert a system turn when none is given
};

}  // namespace infinigen
