// libFuzzer target for the tokenizer file loaders: the first byte picks what the rest is, a
// tokenizer.json (0), a SentencePiece tokenizer.model (1), or vocab.json and merges.txt
// separated by a NUL byte (2); the files are written to a folder and loaded with
// Tokenizer::Load. Whatever the bytes: an error, or a tokenizer that encodes and decodes a fixed
// text (and arbitrary ids) without a sanitizer report. scripts/fuzz.sh builds it with clang.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "gpu_worker/tokenizer/tokenizer.h"

namespace {

void Write(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) __builtin_trap();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const std::string dir = "/dev/shm/infinigen_tok_fuzz_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const uint8_t kind = data[0] % 3;
  const uint8_t* body = data + 1;
  const size_t n = size - 1;
  if (kind == 0) {
    Write(dir + "/tokenizer.json", body, n);
  } else if (kind == 1) {
    Write(dir + "/tokenizer.model", body, n);
  } else {
    size_t cut = 0;
    while (cut < n && body[cut] != 0) ++cut;
    Write(dir + "/vocab.json", body, cut);
    Write(dir + "/merges.txt", body + std::min(cut + 1, n), n - std::min(cut + 1, n));
  }
  auto tokenizer = infinigen::Tokenizer::Load(kind == 1 ? dir + "/tokenizer.model" : dir);
  if (!tokenizer.ok()) return 0;
  const auto ids = (*tokenizer)->Encode("Hello world! caf\xc3\xa9 \xe2\x82\xac 123\n\tend", true);
  (void)(*tokenizer)->Decode(ids);
  std::vector<int32_t> raw = {
      -1, 0, 1, 2, 255, 256, 1000, (*tokenizer)->vocab_size() - 1, (*tokenizer)->vocab_size()};
  (void)(*tokenizer)->Decode(raw, /*skip_special=*/true);
  infinigen::IncrementalDecoder stream(**tokenizer, false);
  for (int32_t id : raw) (void)stream.Add(id);
  (void)stream.Finish();
  return 0;
}
