#include <cstdio>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/sampling_flags.h"
#include "common/status_macros.h"
#include "frontend/prompt.h"
#include "frontend/sample_text.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/kv/backend_kv_cache.h"

namespace infinigen::cli {
namespace {

// --chat '[{"role": "user", "content": "..."}]' -> messages.
absl::StatusOr<std::vector<ChatMessage>> ParseMessages(const std::string& text) {
  IG_ASSIGN_OR_RETURN(auto pairs, ParseChatFlag(text));
  std::vector<ChatMessage> messages;
  for (auto& [role, content] : pairs) messages.push_back({std::move(role), std::move(content)});
  return messages;
}

// The prompt's token ids from exactly one of --prompt-ids, --prompt, --chat.
absl::StatusOr<std::vector<int32_t>> PromptIds(const std::string& ids, const std::string& text,
                                               const std::string& chat,
                                               const std::string& chat_format,
                                               const Tokenizer* tokenizer) {
  if ((!ids.empty()) + (!text.empty()) + (!chat.empty()) != 1) {
    return absl::InvalidArgumentError("give exactly one of --prompt-ids, --prompt and --chat");
  }
  if (!ids.empty()) return ParseIdList(ids, "prompt-ids");
  if (!text.empty()) return EncodeTextPrompt(*tokenizer, text);
  auto messages = ParseMessages(chat);
  if (!messages.ok()) return messages.status();
  return EncodeChatPrompt(*tokenizer, *messages, chat_format);
}

}  // namespace

int RunGenerate(int argc, char** argv) {
  std::string model_path, prompt_ids, prompt, chat, chat_format;
  SamplingFlags sampling;
  bool print_ids = false;
  BackendSpec backend;
  FlagSet flags("infinigen generate",
                "--model PATH (--prompt TEXT | --chat JSON | --prompt-ids 1,2,3)",
                "Generates a continuation with the model on the CPU and streams the text to "
                "stdout (token ids with --ids). Statistics go to stderr.");
  flags.String("model", &model_path, "model folder (config.json + safetensors) or .gguf file");
  flags.String("prompt", &prompt, "prompt text (BOS added as the tokenizer says)");
  flags.String("chat", &chat,
               "conversation as JSON: [{\"role\": \"user\", \"content\": \"...\"}, ...], "
               "rendered with the model's chat template");
  flags.String("chat-format", &chat_format,
               "use this chat format instead of the model's template: llama3, llama2, chatml");
  flags.String("prompt-ids", &prompt_ids, "prompt as comma-separated token ids");
  sampling.Register(flags);
  flags.Bool("ids", &print_ids, "print the generated token ids as a JSON array, not text");
  RegisterBackendFlags(flags, backend);
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("generate", parsed.status());
  if (!*parsed) return 0;
  if (model_path.empty()) {
    return ReportError("generate", absl::InvalidArgumentError("--model is required"));
  }

  auto sampling_options = sampling.Options();
  if (!sampling_options.ok()) return ReportError("generate", sampling_options.status());
  GenerateOptions options = *sampling_options;

  auto loaded = LoadModel(model_path, backend);
  if (!loaded.ok()) return ReportError("generate", loaded.status());
  std::unique_ptr<Tokenizer> tokenizer;
  if (prompt_ids.empty() || !print_ids) {
    auto t = LoadTokenizer(*loaded->checkpoint);
    if (!t.ok()) return ReportError("generate", t.status());
    tokenizer = std::move(*t);
  }
  auto prompt_tokens = PromptIds(prompt_ids, prompt, chat, chat_format, tokenizer.get());
  if (!prompt_tokens.ok()) return ReportError("generate", prompt_tokens.status());

  Model& model = *loaded->model;
  BackendKvCache cache(model.backend(), model.kv_shape());
  SampleText text(print_ids ? nullptr : tokenizer.get(), /*skip_special=*/true,
                  /*stop_strings=*/{}, /*include_stop=*/false);
  auto result = Generate(model, cache, /*seq=*/1, *prompt_tokens, options, [&](int32_t token) {
    if (text.has_text()) std::cout << text.Add(token) << std::flush;
    return true;
  });
  if (!result.ok()) return ReportError("generate", result.status());
  if (text.has_text()) {
    std::cout << text.Finish() << "\n";
  } else {
    std::cout << "[" << absl::StrJoin(result->tokens, ",") << "]\n";
  }
  const double decode_tps =
      result->tokens.size() > 1 ? (result->tokens.size() - 1) / result->decode_seconds : 0.0;
  std::cerr << absl::StrCat("prompt ", result->prompt_tokens, " tokens in ",
                            result->prefill_seconds, " s; generated ", result->tokens.size(),
                            " tokens (", FinishReasonName(result->finish_reason), "), ", decode_tps,
                            " tokens/s\n");
  return 0;
}

}  // namespace infinigen::cli
