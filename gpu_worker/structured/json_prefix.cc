#include "gpu_worker/structured/json_prefix.h"

namespace infinigen {
namespace {

bool IsWhitespace(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool IsDigit(uint8_t c) { return c >= '0' && c <= '9'; }
int HexValue(uint8_t c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

constexpr std::string_view kLiterals[] = {"true", "false", "null"};

}  // namespace

bool JsonPrefix::Push(bool object) {
  if (depth_ >= kMaxDepth) return false;
  const uint64_t bit = uint64_t{1} << depth_;
  objects_ = object ? objects_ | bit : objects_ & ~bit;
  ++depth_;
  mode_ = object ? Mode::kObjectFirst : Mode::kArrayFirst;
  return true;
}

bool JsonPrefix::Close(bool object) {
  if (depth_ == 0 || InObject() != object) return false;
  --depth_;
  EndValue();
  return true;
}

bool JsonPrefix::BeginValue(uint8_t c) {
  switch (c) {
    case '{':
      return Push(true);
    case '[':
      return Push(false);
    case '"':
      mode_ = Mode::kString;
      key_ = false;
      return true;
    case '-':
      mode_ = Mode::kMinus;
      return true;
    case '0':
      mode_ = Mode::kZero;
      return true;
    case 't':
    case 'f':
    case 'n':
      mode_ = Mode::kLiteral;
      literal_ = c == 't' ? 0 : c == 'f' ? 1 : 2;
      literal_at_ = 1;
      return true;
    default:
      if (c >= '1' && c <= '9') {
        mode_ = Mode::kInt;
        return true;
      }
      return false;
  }
}

bool JsonPrefix::StringByte(uint8_t c) {
  if (c == '"') {
    if (key_) {
      key_ = false;
      mode_ = Mode::kColon;
    } else {
      EndValue();
    }
    return true;
  }
  if (c == '\\') {
    mode_ = Mode::kEscape;
    return true;
  }
  if (c < 0x20) return false;  // control characters must be escaped
  if (c < 0x80) return true;
  // A UTF-8 lead byte: how many continuation bytes, and the first one's range (no overlong
  // forms, no surrogates, nothing past U+10FFFF).
  utf8_lo_ = 0x80;
  utf8_hi_ = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    utf8_left_ = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    utf8_left_ = 2;
    if (c == 0xE0) utf8_lo_ = 0xA0;
    if (c == 0xED) utf8_hi_ = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    utf8_left_ = 3;
    if (c == 0xF0) utf8_lo_ = 0x90;
    if (c == 0xF4) utf8_hi_ = 0x8F;
  } else {
    return false;
  }
  mode_ = Mode::kUtf8;
  return true;
}

bool JsonPrefix::NumberEnds(uint8_t c) {
  EndValue();
  return Feed(c);
}

bool JsonPrefix::Complete() const {
  if (mode_ == Mode::kDone) return true;
  // A number at the top needs no byte after it (a document that is not an object).
  return depth_ == 0 && (mode_ == Mode::kZero || mode_ == Mode::kInt || mode_ == Mode::kFrac ||
                         mode_ == Mode::kExpDigits);
}

bool JsonPrefix::Feed(uint8_t c) {
  const bool space = IsWhitespace(c);
  if (!space) whitespace_run_ = 0;
  // Structural modes: whitespace between tokens, at most kMaxWhitespaceRun bytes in a row.
  auto blank = [&] { return ++whitespace_run_ <= kMaxWhitespaceRun; };
  switch (mode_) {
    case Mode::kStart:
      if (space) return blank();
      if (object_only_ && c != '{') return false;
      return BeginValue(c);
    case Mode::kValue:
      if (space) return blank();
      return BeginValue(c);
    case Mode::kArrayFirst:
      if (space) return blank();
      if (c == ']') return Close(false);
      return BeginValue(c);
    case Mode::kObjectFirst:
    case Mode::kKey:
      if (space) return blank();
      if (c == '}' && mode_ == Mode::kObjectFirst) return Close(true);
      if (c != '"') return false;
      mode_ = Mode::kString;
      key_ = true;
      return true;
    case Mode::kColon:
      if (space) return blank();
      if (c != ':') return false;
      mode_ = Mode::kValue;
      return true;
    case Mode::kAfterValue:
      if (space) return blank();
      if (c == ',') {
        mode_ = InObject() ? Mode::kKey : Mode::kValue;
        return true;
      }
      if (c == ']' || c == '}') return Close(c == '}');
      return false;
    case Mode::kDone:
      return false;
    case Mode::kString:
      return StringByte(c);
    case Mode::kEscape:
      switch (c) {
        case '"':
        case '\\':
        case '/':
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't':
          mode_ = Mode::kString;
          return true;
        case 'u':
          mode_ = Mode::kUnicode;
          hex_left_ = 4;
          code_ = 0;
          return true;
        default:
          return false;
      }
    case Mode::kUnicode: {
      const int v = HexValue(c);
      if (v < 0) return false;
      code_ = static_cast<uint16_t>(code_ * 16 + v);
      if (--hex_left_ > 0) return true;
      const bool high = code_ >= 0xD800 && code_ <= 0xDBFF;
      const bool low = code_ >= 0xDC00 && code_ <= 0xDFFF;
      if (low_expected_) {  // the second half of a surrogate pair
        if (!low) return false;
        low_expected_ = false;
        mode_ = Mode::kString;
        return true;
      }
      if (low) return false;  // a low surrogate alone
      if (high) {
        low_expected_ = true;
        mode_ = Mode::kLowBackslash;
        return true;
      }
      mode_ = Mode::kString;
      return true;
    }
    case Mode::kLowBackslash:
      if (c != '\\') return false;
      mode_ = Mode::kLowU;
      return true;
    case Mode::kLowU:
      if (c != 'u') return false;
      mode_ = Mode::kUnicode;
      hex_left_ = 4;
      code_ = 0;
      return true;
    case Mode::kUtf8:
      if (c < utf8_lo_ || c > utf8_hi_) return false;
      utf8_lo_ = 0x80;
      utf8_hi_ = 0xBF;
      if (--utf8_left_ == 0) mode_ = Mode::kString;
      return true;
    case Mode::kMinus:
      if (c == '0') {
        mode_ = Mode::kZero;
        return true;
      }
      if (c >= '1' && c <= '9') {
        mode_ = Mode::kInt;
        return true;
      }
      return false;
    case Mode::kZero:
    case Mode::kInt:
      if (IsDigit(c) && mode_ == Mode::kInt) return true;
      if (c == '.') {
        mode_ = Mode::kDot;
        return true;
      }
      if (c == 'e' || c == 'E') {
        mode_ = Mode::kExp;
        return true;
      }
      return NumberEnds(c);
    case Mode::kDot:
      if (!IsDigit(c)) return false;
      mode_ = Mode::kFrac;
      return true;
    case Mode::kFrac:
      if (IsDigit(c)) return true;
      if (c == 'e' || c == 'E') {
        mode_ = Mode::kExp;
        return true;
      }
      return NumberEnds(c);
    case Mode::kExp:
      if (c == '+' || c == '-') {
        mode_ = Mode::kExpSign;
        return true;
      }
      [[fallthrough]];
    case Mode::kExpSign:
      if (!IsDigit(c)) return false;
      mode_ = Mode::kExpDigits;
      return true;
    case Mode::kExpDigits:
      if (IsDigit(c)) return true;
      return NumberEnds(c);
    case Mode::kLiteral: {
      const std::string_view word = kLiterals[literal_];
      if (c != static_cast<uint8_t>(word[literal_at_])) return false;
      if (++literal_at_ == word.size()) EndValue();
      return true;
    }
  }
  return false;
}

}  // namespace infinigen
