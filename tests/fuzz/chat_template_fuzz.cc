// libFuzzer target for chat template rendering: arbitrary message lists (roles and contents from
// the input, NUL-separated) rendered by each template family, and the input's first line taken
// as a Jinja template to recognize. Whatever the messages: an error naming what breaks the
// template's rules, or a prompt that holds every message's plain content (ChatML and Llama 3).
// scripts/fuzz.sh builds it with clang and runs it for a bounded time.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu_worker/tokenizer/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t line = input.find('\n');
  (void)infinigen::ChatTemplate::FromJinja(input.substr(0, line), "<s>", "</s>");
  std::vector<infinigen::ChatMessage> messages;
  std::vector<std::string> fields;
  size_t at = line == std::string::npos ? size : line + 1;
  while (at <= size) {
    const size_t end = std::min(input.find('\0', at), size);
    fields.push_back(input.substr(at, end - at));
    at = end + 1;
  }
  for (size_t i = 0; i + 1 < fields.size(); i += 2) messages.push_back({fields[i], fields[i + 1]});
  for (const char* family : {"chatml", "llama3", "llama2"}) {
    auto t = infinigen::ChatTemplate::ForFormat(family, "<s>", "</s>");
    if (!t.ok()) __builtin_trap();
    for (bool prompt : {true, false}) {
      auto text = t->Render(messages, prompt);
      if (!text.ok() || std::string(family) == "llama2") continue;
      for (const auto& m : messages) {
        // Templates trim contents (Llama 3) and read them as UTF-8: printable ASCII without
        // surrounding spaces must come through unchanged.
        const bool plain = !m.content.empty() && m.content.front() != ' ' &&
                           m.content.back() != ' ' &&
                           std::all_of(m.content.begin(), m.content.end(),
                                       [](char c) { return c >= 0x20 && c < 0x7f; });
        if (plain && text->find(m.content) == std::string::npos) __builtin_trap();  // lost
      }
    }
  }
  return 0;
}
