#include "gpu_worker/tokenizer/chat_template.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gpu_worker/tokenizer/unicode.h"

namespace infinigen {
namespace {

// Jinja's trim / Python's str.strip(): Unicode whitespace plus the ASCII separators 0x1C-0x1F.
std::string Strip(absl::string_view s) {
  const std::vector<uint32_t> cps = unicode::DecodeUtf8(s);
  auto space = [](uint32_t c) { return unicode::IsWhitespace(c) || (c >= 0x1C && c <= 0x1F); };
  size_t b = 0, e = cps.size();
  while (b < e && space(cps[b])) ++b;
  while (e > b && space(cps[e - 1])) --e;
  return unicode::EncodeUtf8(cps.data() + b, e - b);
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromJinja(absl::string_view jinja, std::string bos,
                                                     std::string eos) {
  if (jinja.empty()) {
    return absl::NotFoundError(
        "the model has no chat template; choose a format (llama3, llama2, chatml) explicitly");
  }
  if (absl::StrContains(jinja, "<|start_header_id|>")) {
    if (absl::StrContains(jinja, "Cutting Knowledge Date") || absl::StrContains(jinja, "tools")) {
      return absl::UnimplementedError(
          "the Llama 3.1/3.2 tool-calling chat template is not implemented; use --chat-format "
          "llama3 for the plain Llama 3 format");
    }
    return ChatTemplate(ChatFormat::kLlama3, std::move(bos), std::move(eos));
  }
  if (absl::StrContains(jinja, "[INST]") && absl::StrContains(jinja, "<<SYS>>")) {
    return ChatTemplate(ChatFormat::kLlama2, std::move(bos), std::move(eos));
  }
  if (absl::StrContains(jinja, "<|im_start|>")) {
    ChatTemplate t(ChatFormat::kChatMl, std::move(bos), std::move(eos));
    // "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n...
    // <|im_end|>\n' }}": a default system turn.
    constexpr absl::string_view kOpen = "<|im_start|>system\n";
    const size_t cond = jinja.find("messages[0]['role'] != 'system'");
    const size_t open = cond == absl::string_view::npos ? cond : jinja.find(kOpen, cond);
    if (open != absl::string_view::npos) {
      const size_t close = jinja.find("<|im_end|>", open);
      if (close == absl::string_view::npos) {
        return absl::UnimplementedError("ChatML template with an unterminated system turn");
      }
      t.default_system_ =
          std::string(jinja.substr(open + kOpen.size(), close - open - kOpen.size()));
    }
    return t;
  }
  return absl::UnimplementedError(
      absl::StrCat("chat template not recognized (known: Llama 3, Llama 2, ChatML); it begins: ",
                   jinja.substr(0, 80)));
}

absl::StatusOr<ChatTemplate> ChatTemplate::ForFormat(absl::string_view name, std::string bos,
                                                     std::string eos) {
  if (name == "llama3") return ChatTemplate(ChatFormat::kLlama3, std::move(bos), std::move(eos));
  if (name == "llama2") return ChatTemplate(ChatFormat::kLlama2, std::move(bos), std::move(eos));
  if (name == "chatml") return ChatTemplate(ChatFormat::kChatMl, std::move(bos), std::move(eos));
  return absl::InvalidArgumentError(
      absl::StrCat("unknown chat format '", name, "': expected llama3, llama2 or chatml"));
}

absl::StatusOr<std::string> ChatTemplate::Render(std::span<const ChatMessage> messages,
                                                 bool add_generation_prompt) const {
  std::string out;
  switch (format_) {
    case ChatFormat::kLlama3:
      for (size_t i = 0; i < messages.size(); ++i) {
        if (i == 0) out += bos_;
        absl::StrAppend(&out, "<|start_header_id|>", messages[i].role, "<|end_header_id|>\n\n",
                        Strip(messages[i].content), "<|eot_id|>");
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      return out;
    case ChatFormat::kLlama2: {
      std::span<const ChatMessage> loop = messages;
      const bool has_system = !messages.empty() && messages[0].role == "system";
      if (has_system) loop = messages.subspan(1);
      for (size_t i = 0; i < loop.size(); ++i) {
        const bool user = loop[i].role == "user";
        if (user != (i % 2 == 0)) {
          return absl::InvalidArgumentError(
              "Conversation roles must alternate user/assistant/user/assistant/...");
        }
        std::string content = loop[i].content;
        if (i == 0 && has_system) {
          content = absl::StrCat("<<SYS>>\n", messages[0].content, "\n<</SYS>>\n\n", content);
        }
        if (user) {
          absl::StrAppend(&out, bos_, "[INST] ", Strip(content), " [/INST]");
        } else if (loop[i].role == "assistant") {
          absl::StrAppend(&out, " ", Strip(content), " ", eos_);
        }
      }
      return out;
    }
    case ChatFormat::kChatMl:
      for (size_t i = 0; i < messages.size(); ++i) {
        if (i == 0 && !default_system_.empty() && messages[0].role != "system") {
          absl::StrAppend(&out, "<|im_start|>system\n", default_system_, "<|im_end|>\n");
        }
        absl::StrAppend(&out, "<|im_start|>", messages[i].role, "\n", messages[i].content,
                        "<|im_end|>\n");
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      return out;
  }
  return out;
}

}  // namespace infinigen
