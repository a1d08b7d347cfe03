// UTF-8 and the few Unicode properties the tokenizers need.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace infinigen::unicode {

constexpr uint32_t kReplacementChar = 0xFFFD;

// Replaces every maximal invalid subsequence of `bytes` with U+FFFD (the Unicode "best
// practice", which Python's errors="replace" and Rust's from_utf8_lossy follow). Valid input
// comes back unchanged.
std::string SanitizeUtf8(absl::string_view bytes);

// Bytes of the UTF-8 sequence a lead byte starts (1 for anything that is not a lead byte).
inline size_t Utf8SequenceLength(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

// Code points of valid UTF-8 (sanitize first).
std::vector<uint32_t> DecodeUtf8(absl::string_view utf8);
void AppendUtf8(uint32_t cp, std::string& out);
std::string EncodeUtf8(const uint32_t* cps, size_t n);

// Length of the longest prefix of `bytes` that is complete UTF-8, leaving out a trailing
// sequence that may still be completed by more bytes. Invalid bytes count as complete (they
// will be replaced), so streaming never holds back more than 3 bytes.
size_t CompleteUtf8Prefix(absl::string_view bytes);

// General category L (\p{L}), N (\p{N}), and the White_Space property (\s in Oniguruma).
bool IsLetter(uint32_t cp);
bool IsNumber(uint32_t cp);
bool IsWhitespace(uint32_t cp);

}  // namespace infinigen::unicode
