// Component micro-benchmark of response_format json_object's token mask: one Mask over a real
// tokenizer's vocabulary from a few states of the JSON text (the engine runs one per sequence
// and step). Not the product path: docs/benchmarks.md puts it next to the served cost.
//
// usage: json_mask_bench TOKENIZER [benchmark flags]   (a .gguf, tokenizer.json, ...)
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu_worker/structured/json_token_mask.h"
#include "gpu_worker/tokenizer/tokenizer.h"

namespace {

std::shared_ptr<const infinigen::JsonVocabulary> vocabulary;

// The mask after `text`: what a sequence whose JSON so far is `text` pays a step.
void BM_Mask(benchmark::State& state, const std::string& text) {
  // The state comes from feeding `text` a byte at a time: the vocabulary, with 256 one-byte
  // tokens appended for that (a vocabulary need not have each byte as a token).
  auto bytes = std::make_shared<infinigen::JsonVocabulary>(*vocabulary);
  const size_t base_ids = bytes->bytes.size();
  for (int b = 0; b < 256; ++b) {
    bytes->bytes.push_back(std::string(1, static_cast<char>(b)));
    bytes->usable.push_back(1);
  }
  bytes->Classify();
  infinigen::JsonTokenMask mask(bytes);
  for (char c : text) {
    if (!mask.Accept(static_cast<int32_t>(base_ids + static_cast<uint8_t>(c)))) {
      state.SkipWithError("the text is not a JSON prefix");
      return;
    }
  }
  std::vector<float> row(bytes->bytes.size());
  int64_t allowed = 0;
  for (auto _ : state) {
    std::fill(row.begin(), row.end(), 0.0f);
    benchmark::DoNotOptimize(mask.Mask(row, {}));
    benchmark::ClobberMemory();
  }
  for (float x : row) allowed += x != -INFINITY;
  state.counters["allowed"] = static_cast<double>(allowed);
  state.counters["vocab"] = static_cast<double>(base_ids);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') {
    std::fprintf(stderr, "usage: json_mask_bench TOKENIZER [benchmark flags]\n");
    return 2;
  }
  auto tokenizer = infinigen::Tokenizer::Load(argv[1]);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", tokenizer.status().ToString().c_str());
    return 2;
  }
  vocabulary = infinigen::JsonVocabulary::FromTokenizer(**tokenizer);
  for (const auto& [name, text] :
       std::vector<std::pair<std::string, std::string>>{{"start", ""},
                                                        {"in_key", "{\"na"},
                                                        {"in_string", "{\"name\": \"Fel"},
                                                        {"after_value", "{\"age\": 12"},
                                                        {"after_colon", "{\"age\":"}}) {
    benchmark::RegisterBenchmark(("Mask/" + name).c_str(), BM_Mask, text);
  }
  argv[1] = argv[0];
  --argc;
  ++argv;
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
