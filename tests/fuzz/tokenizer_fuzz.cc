// libFuzzer target for the tokenizers: arbitrary bytes must encode without crashing, decode back
// to the (sanitized) input where the tokenizer is lossless, and arbitrary ids must decode the
// same whole and streamed. scripts/fuzz.sh builds it with clang and runs it for a bounded time.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/tokenizer/tokenizer.h"
#include "gpu_worker/tokenizer/unicode.h"

namespace {

struct Loaded {
  std::unique_ptr<infinigen::Tokenizer> tokenizer;
  bool lossless;
  bool space_symbol_is_space;  // SentencePiece reads a literal U+2581 as a space
};

std::vector<Loaded>& Tokenizers() {
  static auto* all = [] {
    auto* v = new std::vector<Loaded>();
    const char* dir = std::getenv("INFINIGEN_TESTDATA");
    const std::string root = dir != nullptr ? dir : "../shared/testdata";
    struct Entry {
      const char* path;
      bool lossless, spm;
    };
    for (const Entry& e :
         {Entry{"/tokenizers/gpt2", true, false}, Entry{"/tokenizers/llama3.1", true, false},
          Entry{"/tokenizers/llama2-spm/tokenizer.model", true, true},
          Entry{"/tokenizers/mistral-7b", false, true}}) {
      auto t = infinigen::Tokenizer::Load(root + e.path);
      if (!t.ok()) __builtin_trap();  // the harness needs its tokenizers
      v->push_back({std::move(*t), e.lossless, e.spm});
    }
    return v;
  }();
  return *all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::string clean = infinigen::unicode::SanitizeUtf8(text);
  const bool has_space_symbol = clean.find("\xE2\x96\x81") != std::string::npos;
  for (const Loaded& l : Tokenizers()) {
    const auto ids = l.tokenizer->Encode(text, size % 2 == 0);
    const std::string back = l.tokenizer->Decode(ids);
    const bool lossless = l.lossless && !(l.space_symbol_is_space && has_space_symbol);
    if (lossless && size % 2 != 0 && back != clean) __builtin_trap();
    // The bytes as token ids, some out of range: whole and streamed decoding agree.
    std::vector<int32_t> raw;
    for (size_t i = 0; i + 2 <= size; i += 2) {
      raw.push_back(static_cast<int32_t>((data[i] << 8 | data[i + 1]) * 3) - 100);
    }
    infinigen::IncrementalDecoder stream(*l.tokenizer, size % 3 == 0);
    std::string streamed;
    for (int32_t id : raw) streamed += stream.Add(id);
    streamed += stream.Finish();
    if (streamed != l.tokenizer->Decode(raw, size % 3 == 0)) __builtin_trap();
  }
  return 0;
}
