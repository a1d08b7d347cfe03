// Encoding throughput of one tokenizer on one text, on one core: the best of several passes,
// printed as one JSON line. scripts/bench/tokenizer_vs_hf.py runs it next to Hugging Face
// tokenizers on the same text.
//
// usage: tokenizer_bench TOKENIZER TEXT_FILE [REPETITIONS]
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "gpu_worker/tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: tokenizer_bench TOKENIZER TEXT_FILE [REPETITIONS]\n";
    return 2;
  }
  auto tok = infinigen::Tokenizer::Load(argv[1]);
  if (!tok.ok()) {
    std::cerr << tok.status() << "\n";
    return 2;
  }
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) {
    std::cerr << argv[2] << ": cannot open\n";
    return 2;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  double best = 1e30;
  size_t tokens = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    tokens = (*tok)->Encode(text).size();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf(
      "{\"engine\": \"infinigen\", \"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.4f, "
      "\"mb_per_s\": %.3f}\n",
      text.size(), tokens, best, text.size() / best / 1e6);
  return 0;
}
