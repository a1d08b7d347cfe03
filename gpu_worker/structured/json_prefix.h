// A byte-at-a-time recognizer of JSON text (RFC 8259) that tells, after each byte, whether what it
// has read so far can still be completed to a valid document, and whether it is one: the
// grammar behind OpenAI's `response_format: {"type": "json_object"}` (the document an object).
// Strings are checked as JSON parsers check them: control characters refused, escapes
// (\uXXXX with its surrogate pairs) and UTF-8 well-formed (no overlong forms, no surrogates).
// Two limits that JSON has not, so that a model cannot run away inside the grammar: at most
// kMaxDepth nested containers, and at most kMaxWhitespaceRun whitespace bytes in a row outside
// strings. Nothing may follow the document, whitespace included.
//
// The state is a small value (copy it to try a continuation).
#pragma once

#include <cstdint>
#include <string_view>

namespace infinigen {

class JsonPrefix {
 public:
  static constexpr int kMaxDepth = 64;
  static constexpr int kMaxWhitespaceRun = 24;

  // `object_only`: the document must be an object (json_object); otherwise any value.
  explicit JsonPrefix(bool object_only = true) : object_only_(object_only) {}

  // Reads one byte; false (the state then unspecified) when no valid document begins with what
  // was read and this byte.
  bool Feed(uint8_t c);
  // Every byte of `bytes`; false when one is refused.
  bool Feed(std::string_view bytes) {
    for (char c : bytes) {
      if (!Feed(static_cast<uint8_t>(c))) return false;
    }
    return true;
  }
  // What was read is a whole document.
  bool Complete() const;
  // Inside a string, between characters: any byte but '"', '\\' and controls may come (and
  // whole UTF-8 characters).
  bool InStringBody() const { return mode_ == Mode::kString; }

 private:
  enum class Mode : uint8_t {
    kStart,         // before the document
    kValue,         // a value must come (after ':' or ',' in an array)
    kArrayFirst,    // after '[': a value or ']'
    kObjectFirst,   // after '{': a key or '}'
    kKey,           // after ',' in an object: a key
    kColon,         // after a key
    kAfterValue,    // after a value inside a container: ',' or its close
    kDone,          // the document is whole
    kString,        // inside a string (key_ says which kind)
    kEscape,        // after '\' in a string
    kUnicode,       // in \uXXXX: hex_left_ digits to come
    kLowBackslash,  // a high surrogate's \u: its low surrogate's '\' must come
    kLowU,          // ... then 'u'
    kUtf8,          // inside a multi-byte UTF-8 character: utf8_left_ bytes to come
    kMinus,         // a number's '-'
    kZero,          // a number's leading 0
    kInt,           // its integer digits
    kDot,           // after '.'
    kFrac,          // fraction digits
    kExp,           // after 'e' or 'E'
    kExpSign,       // after the exponent's sign
    kExpDigits,     // exponent digits
    kLiteral,       // inside true, false or null: literal_ and literal_at_
  };

  bool BeginValue(uint8_t c);
  // A value ended: what comes after it.
  void EndValue() { mode_ = depth_ == 0 ? Mode::kDone : Mode::kAfterValue; }
  bool Push(bool object);
  bool Close(bool object);
  bool InObject() const { return depth_ > 0 && ((objects_ >> (depth_ - 1)) & 1) != 0; }
  bool StringByte(uint8_t c);
  bool NumberEnds(uint8_t c);  // a byte after a complete number

  bool object_only_;
  Mode mode_ = Mode::kStart;
  bool key_ = false;                         // the string is an object's key
  uint8_t depth_ = 0;                        // open containers
  uint8_t whitespace_run_ = 0;               // whitespace bytes in a row
  uint8_t hex_left_ = 0;                     // \u digits to come
  uint8_t utf8_left_ = 0;                    // UTF-8 continuation bytes to come
  uint8_t utf8_lo_ = 0x80, utf8_hi_ = 0xBF;  // the next continuation byte's range
  uint8_t literal_ = 0, literal_at_ = 0;     // which of true/false/null, and how far
  uint16_t code_ = 0;                        // the \u escape's value so far
  bool low_expected_ = false;                // the \u escape read must be a low surrogate
  uint64_t objects_ = 0;                     // bit i: container i is an object (else an array)
};

}  // namespace infinigen
