#include "gpu_worker/tokenizer/pre_tokenizer.h"

#include "absl/strings/str_cat.h"
#include "gpu_worker/tokenizer/unicode.h"

namespace infinigen {
namespace {

using unicode::IsLetter;
using unicode::IsNumber;
using unicode::IsWhitespace;

constexpr absl::string_view kGpt2Regex =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
constexpr absl::string_view kLlama3Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

bool IsOther(uint32_t c) { return !IsWhitespace(c) && !IsLetter(c) && !IsNumber(c); }
bool IsNewline(uint32_t c) { return c == '\r' || c == '\n'; }
uint32_t Lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

// Length of a contraction ('s 't 're 've 'm 'll 'd) at cps[i], or 0.
size_t Contraction(const uint32_t* cps, size_t i, size_t n, bool ignore_case) {
  if (cps[i] != '\'' || i + 1 >= n) return 0;
  auto at = [&](size_t k) { return ignore_case ? Lower(cps[k]) : cps[k]; };
  const uint32_t c1 = at(i + 1);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (i + 2 < n) {
    const uint32_t c2 = at(i + 2);
    if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  }
  return 0;
}

// \s+(?!\S) then \s+, at a whitespace code point: a run followed by a non-space leaves its last
// space for the next piece (unless the run is that one space).
size_t WhitespaceRun(const uint32_t* cps, size_t i, size_t n) {
  size_t j = i;
  while (j < n && IsWhitespace(cps[j])) ++j;
  if (j < n && j - i > 1) return j - i - 1;
  return j - i;
}

size_t Gpt2Piece(const uint32_t* cps, size_t i, size_t n) {
  if (size_t c = Contraction(cps, i, n, false)) return c;
  const bool space = cps[i] == ' ' && i + 1 < n;
  const size_t s = space ? i + 1 : i;  // after the optional leading space
  size_t j = s;
  if (IsLetter(cps[s])) {
    while (j < n && IsLetter(cps[j])) ++j;
    return j - i;
  }
  if (IsNumber(cps[s])) {
    while (j < n && IsNumber(cps[j])) ++j;
    return j - i;
  }
  if (IsOther(cps[s])) {
    while (j < n && IsOther(cps[j])) ++j;
    return j - i;
  }
  return WhitespaceRun(cps, i, n);
}

size_t Llama3Piece(const uint32_t* cps, size_t i, size_t n) {
  if (size_t c = Contraction(cps, i, n, true)) return c;
  const uint32_t c0 = cps[i];
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (IsLetter(c0) || (!IsNewline(c0) && !IsNumber(c0) && i + 1 < n && IsLetter(cps[i + 1]))) {
    size_t j = i + 1;
    while (j < n && IsLetter(cps[j])) ++j;
    return j - i;
  }
  // \p{N}{1,3}
  if (IsNumber(c0)) {
    size_t j = i;
    while (j < n && j - i < 3 && IsNumber(cps[j])) ++j;
    return j - i;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  const size_t s = c0 == ' ' && i + 1 < n ? i + 1 : i;
  if (IsOther(cps[s])) {
    size_t j = s;
    while (j < n && IsOther(cps[j])) ++j;
    while (j < n && IsNewline(cps[j])) ++j;
    return j - i;
  }
  // \s*[\r\n]+ : the whitespace run up to and including its last newline.
  size_t j = i, last_newline = 0;
  while (j < n && IsWhitespace(cps[j])) {
    if (IsNewline(cps[j])) last_newline = j + 1;
    ++j;
  }
  if (last_newline > 0) return last_newline - i;
  return WhitespaceRun(cps, i, n);
}

}  // namespace

absl::StatusOr<SplitPattern> RecognizeSplitRegex(absl::string_view regex) {
  if (regex == kGpt2Regex) return SplitPattern::kGpt2;
  if (regex == kLlama3Regex) return SplitPattern::kLlama3;
  return absl::UnimplementedError(absl::StrCat(
      "pre-tokenizer regex is not one this tokenizer implements (GPT-2 or Llama 3): ", regex));
}

void SplitByPattern(SplitPattern pattern, const uint32_t* cps, size_t n,
                    std::vector<std::pair<size_t, size_t>>& out) {
  if (pattern == SplitPattern::kNone) {
    if (n > 0) out.emplace_back(0, n);
    return;
  }
  size_t i = 0;
  while (i < n) {
    size_t len = pattern == SplitPattern::kGpt2 ? Gpt2Piece(cps, i, n) : Llama3Piece(cps, i, n);
    if (len == 0) len = 1;
    out.emplace_back(i, i + len);
    i += len;
  }
}

void SplitDigits(const uint32_t* cps, size_t n, std::vector<std::pair<size_t, size_t>>& out) {
  size_t start = 0;
  for (size_t i = 0; i < n; ++i) {
    if (IsNumber(cps[i])) {
      if (i > start) out.emplace_back(start, i);
      out.emplace_back(i, i + 1);
      start = i + 1;
    }
  }
  if (start < n) out.emplace_back(start, n);
}

const ByteLevelMap& ByteLevelMap::Get() {
  static const ByteLevelMap* map = new ByteLevelMap();
  return *map;
}

ByteLevelMap::ByteLevelMap() {
  // Printable bytes map to themselves; the rest to 256, 257, ... in byte order.
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    byte_to_cp_[b] = printable ? b : next++;
  }
  for (int& v : cp_to_byte_) v = -1;
  for (int b = 0; b < 256; ++b) {
    cp_to_byte_[byte_to_cp_[b]] = b;
    unicode::AppendUtf8(byte_to_cp_[b], byte_to_utf8_[b]);
  }
}

void ByteLevelMap::Encode(absl::string_view bytes, std::string& out) const {
  for (unsigned char b : bytes) out += byte_to_utf8_[b];
}

int ByteLevelMap::Decode(uint32_t cp) const { return cp < 324 ? cp_to_byte_[cp] : -1; }

}  // namespace infinigen
