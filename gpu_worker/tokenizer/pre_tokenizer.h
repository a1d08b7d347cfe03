// Pre-tokenization: splitting text into the pieces BPE runs on. The regexes of the model
// families are implemented by hand (no regex engine), each matching exactly what its pattern
// matches under Oniguruma, which Hugging Face tokenizers uses.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

enum class SplitPattern {
  kNone,
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
  //  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
};

// Which hand-written splitter a tokenizer.json Split regex is; an error names unknown patterns.
absl::StatusOr<SplitPattern> RecognizeSplitRegex(absl::string_view regex);

// Appends [begin, end) code point ranges of the pieces of cps[0, n) to `out`.
void SplitByPattern(SplitPattern pattern, const uint32_t* cps, size_t n,
                    std::vector<std::pair<size_t, size_t>>& out);
// Hugging Face's Digits(individual_digits=true): every \p{N} code point its own piece.
void SplitDigits(const uint32_t* cps, size_t n, std::vector<std::pair<size_t, size_t>>& out);

// GPT-2's reversible byte <-> printable character map (ByteLevel pre-tokenizer and decoder).
class ByteLevelMap {
 public:
  static const ByteLevelMap& Get();
  // Appends the byte-level characters (UTF-8) of raw `bytes`.
  void Encode(absl::string_view bytes, std::string& out) const;
  // The byte a byte-level character stands for, or -1.
  int Decode(uint32_t cp) const;

 private:
  ByteLevelMap();
  uint32_t byte_to_cp_[256];
  std::string byte_to_utf8_[256];
  int cp_to_byte_[324];  // every mapped code point is below 324
};

}  // namespace infinigen
