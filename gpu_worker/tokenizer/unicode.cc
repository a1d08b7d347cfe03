#include "gpu_worker/tokenizer/unicode.h"

#include <algorithm>

namespace infinigen::unicode {
namespace {

struct CodepointRange {
  uint32_t first, last;
};

#include "gpu_worker/tokenizer/unicode_tables.inc"

template <size_t N>
bool InRanges(const CodepointRange (&ranges)[N], uint32_t cp) {
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                             [](uint32_t v, const CodepointRange& r) { return v < r.first; });
  return it != std::begin(ranges) && cp <= std::prev(it)->last;
}

// Decodes one code point at bytes[i]. Returns its length, or 0 for an invalid lead byte; for a
// truncated or broken sequence returns the negated length of the maximal invalid subpart.
int DecodeOne(absl::string_view bytes, size_t i, uint32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(bytes[k]); };
  const uint8_t b0 = b(i);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  int need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
    *cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    *cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    *cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= bytes.size()) return -k;
    const uint8_t c = b(i + k);
    if (c < lo || c > hi) return -k;
    lo = 0x80;
    hi = 0xBF;
    *cp = (*cp << 6) | (c & 0x3F);
  }
  return need + 1;
}

}  // namespace

std::string SanitizeUtf8(absl::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    uint32_t cp;
    const int n = DecodeOne(bytes, i, &cp);
    if (n > 0) {
      out.append(bytes.data() + i, n);
      i += n;
    } else {
      AppendUtf8(kReplacementChar, out);
      i += n == 0 ? 1 : -n;
    }
  }
  return out;
}

std::vector<uint32_t> DecodeUtf8(absl::string_view utf8) {
  std::vector<uint32_t> cps;
  cps.reserve(utf8.size());
  size_t i = 0;
  while (i < utf8.size()) {
    uint32_t cp;
    const int n = DecodeOne(utf8, i, &cp);
    if (n > 0) {
      cps.push_back(cp);
      i += n;
    } else {
      cps.push_back(kReplacementChar);
      i += n == 0 ? 1 : -n;
    }
  }
  return cps;
}

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string EncodeUtf8(const uint32_t* cps, size_t n) {
  std::string out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) AppendUtf8(cps[i], out);
  return out;
}

size_t CompleteUtf8Prefix(absl::string_view bytes) {
  // Only the last 3 bytes can start a sequence that more bytes would complete.
  const size_t start = bytes.size() > 3 ? bytes.size() - 3 : 0;
  for (size_t i = start; i < bytes.size(); ++i) {
    uint32_t cp;
    const int n = DecodeOne(bytes, i, &cp);
    // A negative result that ran into the end of the input is an unfinished sequence.
    if (n < 0 && i + static_cast<size_t>(-n) >= bytes.size()) return i;
    if (n > 1) i += n - 1;
  }
  return bytes.size();
}

bool IsLetter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return InRanges(kLetterRanges, cp);
}

bool IsNumber(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return InRanges(kNumberRanges, cp);
}

bool IsWhitespace(uint32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

}  // namespace infinigen::unicode
